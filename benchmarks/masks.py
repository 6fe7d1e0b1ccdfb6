"""``seqpar bench masks`` as a script: ``python benchmarks/masks.py --help``.

The code lives in ``seqpar.bench.masks``, so installed copies of seqpar can run it too.
"""

import sys

from seqpar.bench.masks import main

if __name__ == "__main__":
    sys.exit(main())
