"""``python -m flax_transformer`` is the ``flax-transformer`` command."""

import sys

from .cli import main

sys.exit(main())
