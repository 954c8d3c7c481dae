"""``python -m arraytrain train``: the same as the ``arraytrain`` console script."""

import sys

from .cli import main

sys.exit(main())
