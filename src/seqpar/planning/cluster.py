"""The machines a plan is for: device count, memory, FLOP rate and links, and the calibration file that sets them.

Rates are given as vendors quote them; ``Cluster`` turns them into the one-way bytes/s the time model uses.
Device memory is given as the card is labelled, which is in GiB (Note [device memory units]).

Note [device memory units]
    Vendors label device memory in binary units while writing "GB": an "80 GB" H100 has 80 GiB of HBM
    (85.9e9 bytes), of which CUDA sees 81,559 MiB (79.6 GiB: nvidia-smi's total, the second value of
    ``torch.cuda.mem_get_info``), 0.4% less than the label. ``Cluster.gpu_memory_gb`` (``seqpar plan
    --gpu-memory-gb``) therefore takes the label's number as GiB (2^30 bytes), and the planner prints memory
    in GiB too (``seqpar estimate`` and ``seqpar train --max-memory-mb`` use MiB, 2^20 bytes).
    ``memory_headroom`` (0.9) covers what the label has and a program cannot use: the 0.4% an H100 does not
    show, the CUDA context (about 0.5 GiB), kernel workspaces and the caching allocator's fragmentation. To
    plan with a measured total instead, give ``mem_get_info``'s total bytes / 2^30.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace

from seqpar.errors import SeqparInputError


@dataclass(frozen=True)
class Cluster:
    """Devices, their memory and speed, and the links between them."""

    gpus: int
    """Devices in all (the world size)."""
    gpus_per_node: int = 8
    """Devices that share the fast intra-node links (NVLink); a node's devices are consecutive ranks."""
    gpu_memory_gb: float = 80.0
    """Memory of one device as its label gives it, read as GiB (2^30 bytes): 80 for an "80 GB" H100, whose
    80 GiB CUDA shows as 81,559 MiB (Note [device memory units]). A plan fills ``memory_headroom`` of it."""
    gpu_tflops: float = 989.0
    """Dense peak of one device at the training dtype, in TFLOP/s (H100 SXM bf16: 989)."""
    intra_node_gbps: float = 900.0
    """Intra-node bandwidth per device in GB/s, both directions together as vendors quote NVLink (H100: 900)."""
    inter_node_gbps: float = 400.0
    """Inter-node bandwidth per device in Gbit/s, the NIC line rate (NDR InfiniBand: 400)."""
    matmul_efficiency: float = 0.6
    """Fraction of gpu_tflops the projection and MLP matmuls reach."""
    attention_efficiency: float = 0.45
    """Fraction of gpu_tflops the attention kernels reach (flash-style kernels run below dense GEMMs)."""
    link_efficiency: float = 0.75
    """Fraction of a link's one-way rate that collectives reach."""
    memory_headroom: float = 0.9
    """Fraction of gpu_memory_gb a plan may fill (the rest: allocator fragmentation, CUDA context, kernels)."""
    ulysses_across_nodes: bool = False
    """Allow all-to-all groups (and tensor parallel) that span nodes."""
    host_link_gbps: float = 50.0
    """Device <-> host memory bandwidth in GB/s (1e9 bytes/s), each direction, that pinned copies reach: PCIe
    Gen5 x16 is 64 GB/s raw per direction, about 50 effective (Gen4: about 25). Used by optimizer offload."""
    host_adam_gparams_per_s: float = 1.0
    """Billions of parameters per second that one node's CPUs update with AdamW under optimizer offload,
    shared by the node's ranks. AdamW on the host is memory-bound: it reads and writes about 28 bytes per
    fp32 parameter (the parameter, its gradient, two states), so 1e9 parameters/s is ~28 GB/s of host memory
    traffic, what PyTorch's multi-threaded AdamW on CPU tensors sustains on a many-core server (a tuned CPU
    Adam such as DeepSpeed's goes several times faster)."""

    def __post_init__(self) -> None:
        problems = [f.name for f in fields(self) if f.name != "ulysses_across_nodes" and not getattr(self, f.name) > 0]
        if problems:
            raise SeqparInputError(f"cluster: {', '.join(problems)} must be positive")
        if self.gpus_per_node > self.gpus and self.gpus % self.gpus_per_node:
            object.__setattr__(self, "gpus_per_node", self.gpus)
        if self.gpus % self.gpus_per_node:
            raise SeqparInputError(f"cluster: {self.gpus} devices do not fill nodes of {self.gpus_per_node}")
        if any(not 0 < e <= 1 for e in (self.matmul_efficiency, self.attention_efficiency, self.link_efficiency)):
            raise SeqparInputError("cluster: efficiencies must lie in (0, 1]")

    @property
    def matmul_flops(self) -> float:
        """FLOP/s one device reaches in matmuls."""
        return self.gpu_tflops * 1e12 * self.matmul_efficiency

    @property
    def attention_flops(self) -> float:
        """FLOP/s one device reaches in attention."""
        return self.gpu_tflops * 1e12 * self.attention_efficiency

    @property
    def intra_bytes_per_s(self) -> float:
        """One-way bytes/s a device reaches to a device of its own node."""
        return self.intra_node_gbps * 1e9 / 2 * self.link_efficiency

    @property
    def inter_bytes_per_s(self) -> float:
        """One-way bytes/s a device reaches to a device of another node."""
        return self.inter_node_gbps * 1e9 / 8 * self.link_efficiency

    @property
    def memory_bytes(self) -> float:
        """Bytes of one device a plan may fill: ``gpu_memory_gb`` GiB x ``memory_headroom``."""
        return self.gpu_memory_gb * 2**30 * self.memory_headroom

    @property
    def host_bytes_per_s(self) -> float:
        """Bytes/s of a device <-> host copy in one direction."""
        return self.host_link_gbps * 1e9

    @property
    def host_adam_params_per_s(self) -> float:
        """Parameters per second one node's CPUs update with AdamW."""
        return self.host_adam_gparams_per_s * 1e9

    def link(self, span: int) -> float:
        """One-way bytes/s of a collective whose group covers ``span`` consecutive ranks."""
        return self.intra_bytes_per_s if span <= self.gpus_per_node else self.inter_bytes_per_s

    def with_calibration(self, calibration: Calibration) -> Cluster:
        """This cluster with the measured rates of ``calibration`` (efficiencies 1: they are measured)."""
        return replace(
            self,
            gpu_tflops=calibration.matmul_tflops,
            matmul_efficiency=1.0,
            attention_efficiency=min(1.0, calibration.attention_tflops / calibration.matmul_tflops),
            intra_node_gbps=calibration.intra_node_gbps,
            inter_node_gbps=calibration.inter_node_gbps,
            link_efficiency=1.0,
        )


@dataclass(frozen=True)
class Calibration:
    """Rates measured on this machine by ``seqpar plan --calibrate``; the file may be edited by hand."""

    matmul_tflops: float
    """Measured matmul rate of one rank, TFLOP/s."""
    attention_tflops: float
    """Measured causal attention rate (forward + backward) of one rank, TFLOP/s."""
    intra_node_gbps: float
    """Measured rank-to-rank bandwidth as Cluster.intra_node_gbps counts it (GB/s, both directions)."""
    inter_node_gbps: float
    """The same link as Cluster.inter_node_gbps counts it (Gbit/s one way); one machine has no other node."""
    threads: int = 1
    """Threads per rank during the measurement."""
    note: str = ""
    """What was measured and how."""


def save_calibration(calibration: Calibration, path: str) -> None:
    """Write ``calibration`` to ``path`` as JSON.

    Args:
        calibration: the measured rates.
        path: the file to write.
    """
    with open(path, "w") as f:
        json.dump(asdict(calibration), f, indent=2)
        f.write("\n")


def load_calibration(path: str) -> Calibration:
    """Read a calibration file written by ``save_calibration`` (or by hand).

    Args:
        path: the JSON file.

    Returns:
        The rates.

    Raises:
        SeqparInputError: the file is missing, not JSON, or lacks a positive rate.
    """
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as error:
        raise SeqparInputError(f"cannot read calibration file {path}: {error}") from error
    names = {f.name for f in fields(Calibration)}
    rates = ("matmul_tflops", "attention_tflops", "intra_node_gbps", "inter_node_gbps")
    if not isinstance(data, dict) or any(
        not isinstance(data.get(k), (int, float)) or not math.isfinite(data[k]) or data[k] <= 0 for k in rates
    ):
        raise SeqparInputError(f"calibration file {path} needs positive numbers for {', '.join(rates)}")
    return Calibration(**{k: v for k, v in data.items() if k in names})
