"""``seqpar.doctor``: why a sequence-parallel run differs from one process, the library or the setup.

Per-layer comparison of activations and gradients with one process, plus setup pitfalls; ``seqpar doctor`` runs it.
"""

from seqpar.diagnosis.report import DoctorReport
from seqpar.diagnosis.run import doctor

__all__ = ["DoctorReport", "doctor"]
