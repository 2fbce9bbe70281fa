"""``python -m flax_transformer`` is the ``flax-transformer`` command."""

import sys

from flax_transformer.cli import main

sys.exit(main())
