"""The ``flax-transformer`` command (``commands``; ``verify --pair/--bisect`` in ``bisect_cli``) and
the flags the ``train/`` entry points share (``train_flags``); ``inspection`` (``summary``, attention
maps) for ``summary`` and ``attention-map``. The top layer: it imports every
other, and nothing imports it but ``__main__`` and ``train/``."""

from flax_transformer.cli.commands import main

__all__ = ["main"]
