"""``seqpar bench strategies`` as a script: ``python benchmarks/strategies.py --help``.

The code lives in ``seqpar.bench.strategies``, so installed copies of seqpar can run it too.
"""

import sys

from seqpar.bench.strategies import main

if __name__ == "__main__":
    sys.exit(main())
