"""``python -m zero_dtensor.bench``: see :mod:`zero_dtensor.bench.cli`."""

import sys

from .cli import main

sys.exit(main())
