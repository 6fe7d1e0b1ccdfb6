"""``python -m seqpar.cli``: the same as the ``seqpar`` console script."""

import sys

from seqpar.cli import main

sys.exit(main())
