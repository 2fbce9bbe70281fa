"""The models: the notebooks' four families (``former``, ``encoder``, ``gpt``, ``classic``) as Flax
NNX modules, the layers and attention they share, their frozen configs, and generation.

The lowest layer: it imports nothing else of flax_transformer, and never torch. ``configs`` and
``_shared`` are pure Python, so ``torch_reference`` imports them without pulling in JAX: this
``__init__`` must stay empty of imports.
"""
