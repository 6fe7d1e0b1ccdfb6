"""``seqpar bench llama_step`` as a script: ``python benchmarks/llama_step.py --help``.

The code lives in ``seqpar.bench.llama_step``, so installed copies of seqpar can run it too.
"""

import sys

from seqpar.bench.llama_step import main

if __name__ == "__main__":
    sys.exit(main())
