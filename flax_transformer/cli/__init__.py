"""The ``flax-transformer`` command (``commands``; ``verify --pair/--bisect`` in ``bisect_cli``) and
the flags the ``train/`` entry points share (``train_flags``). The top layer: it imports every
other, and nothing imports it but ``__main__`` and ``train/``."""

from flax_transformer.cli.commands import main

__all__ = ["main"]
