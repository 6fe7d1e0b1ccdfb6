"""``seqpar bench attention`` as a script: ``python benchmarks/attention.py --help``.

The code lives in ``seqpar.bench.attention``, so installed copies of seqpar can run it too.
"""

import sys

from seqpar.bench.attention import main

if __name__ == "__main__":
    sys.exit(main())
