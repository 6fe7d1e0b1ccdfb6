"""Tensor parallel: attention heads and the MLP's intermediate width of each decoder block split over "tp".

Collectives (torch's ``parallelize_module``, Megatron-style): an all-reduce over tp after each row-wise
projection in the forward, and one on the input gradient of each column-wise projection in the backward.
Activations between blocks are replicated over tp; gradients are never summed over it (Note [tp x sp]).
"""

from seqpar.tensor_parallel.blocks import apply_tensor_parallel

__all__ = ["apply_tensor_parallel"]
