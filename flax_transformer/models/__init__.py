"""The models: the notebooks' four families (``former``, ``encoder``, ``gpt``, ``classic``) as Flax
NNX modules, the layers and attention they share, their frozen configs, and generation.

The lowest layer: it imports nothing else of flax_transformer, and never torch. ``configs``,
``llama_config`` and the small shared modules (``arg_checks``, ``constructor_records``, ``input_specs``,
``state_dict_errors``, ``shape_logging``, ``generation_args``) are pure Python, so ``torch_reference`` imports them without pulling in JAX: this
``__init__`` must stay empty of imports.
"""
