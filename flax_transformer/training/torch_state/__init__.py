"""A torch training checkpoint (model, Adam/AdamW moments, LambdaLR, step) and a JAX run, both ways.

* ``checks``: a torch training checkpoint checked as numbers before anything reads it (``TorchStateError``);
* ``to_jax``: one continued in JAX (``import_torch_state``), and the notebooks' torch optimizer (``torch_optimizer``);
* ``to_torch``: a model and its optimizer written as one (``save_torch_state``), what the tasks export with;
* ``run_export``: a run directory, by its path, as one and back (``export_run``, ``restore_run``);
* ``continuity``: a run continued across one, both ways, against the run that did not switch.

The modules import one way, in that order; import each by its full path (this ``__init__`` holds no names).
"""
