"""Data parallel: the batch's rows split over the mesh's "dp" axis, gradients summed over the dp x sp ranks.

Collectives: FSDP2 all-gathers each unit's parameter shards and reduce-scatters (sums) its gradients; DDP
all-reduces gradients (Note [summed gradients]). Both run over the flattened dp x sp group, never over "tp".
"""

from seqpar.data_parallel.wrappers import apply_data_parallel, data_parallel_group, decoder_blocks

__all__ = ["apply_data_parallel", "data_parallel_group", "decoder_blocks"]
