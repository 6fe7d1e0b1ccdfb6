"""``seqpar bench cuda`` as a script: ``python benchmarks/cuda.py --help``.

The code lives in ``seqpar.bench.cuda``, so installed copies of seqpar can run it too.
"""

import sys

from seqpar.bench.cuda import main

if __name__ == "__main__":
    sys.exit(main())
