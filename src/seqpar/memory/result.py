"""What ``seqpar.estimate_memory`` returns: one rank's predicted bytes by category, the peak and its moment.

Kept apart from the formulas (estimate.py, Note [memory estimate]) so that readers of a result need only this.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_MB = 2**20


@dataclass
class MemoryEstimate:
    """Predicted bytes on one rank during one training step, by category (Note [memory estimate])."""

    parameters: int
    """Model parameters held by this rank (sharded by tp; by dp x sp under fsdp). With ``offload_optimizer``
    the device's working copies only: the root unit's and two gathered decoder blocks'."""
    gradients: int
    """Parameter gradients at the moment of the peak (the output head's alone at the start of the backward)."""
    optimizer_state: int
    """Optimizer state (AdamW: two tensors per parameter), plus its update's temporary when that is the peak
    (0 on the device with ``offload_optimizer``: see ``host``)."""
    checkpointed_activations: int
    """Activations every layer keeps for the backward: whole layers without checkpointing, each layer's input
    with it (0 on the device when offloaded); under pipeline parallel, for the micro-batches in flight, and
    with the interleaved schedule also the sends it holds until the step ends (Note [pipeline memory and time])."""
    layer_transient: int
    """The largest transient of one layer: its recomputed activations (checkpointing) and the gradients of
    its backward, MLP chunks included, attention kernel buffers."""
    logits_loss: int
    """Logits, log-softmax and their gradients: whole [T, V] or one chunk of them; on a pipeline's last rank
    also the logits and log-softmaxes its schedule holds for other micro-batches."""
    communication: int
    """Attention communication buffers of the chosen strategy, or the gradient all-reduce's bucket when that
    moment is the peak."""
    peak: int
    """Largest total over the moments of the step (see ``moment``)."""
    moment: str
    """Which moment sets the peak: "backward start", "layer backward", "gradient all-reduce" or "optimizer"."""
    between_steps: int
    """Bytes that live between steps (parameters, optimizer state, and gradients when they are kept): the
    baseline of ``step_peak``."""
    tokens_per_rank: int
    """Tokens of one micro-batch on this rank (micro_batch x seq_len / sp)."""
    strategy: str
    """Attention strategy the estimate assumes (``auto`` resolved)."""
    features: tuple[str, ...] = field(default_factory=tuple)
    """Memory features switched on."""
    host: int = 0
    """Bytes of host memory the step holds, not part of ``peak``: the fp32 master parameters, gradients and
    optimizer state under ``offload_optimizer``, and the checkpointed layer inputs the "offload" feature moves."""
    offload_optimizer: bool = False
    """Parameters, gradients and optimizer state live in host memory; the update runs on the CPU."""
    pipeline_buffers: int = 0
    """Pipeline parallel: the receive buffers torch's stages keep from step to step, one [micro_batch, S/sp, H]
    activation (or its gradient) per micro-batch and stage boundary (Note [pipeline memory and time]); part
    of ``peak`` and ``between_steps``."""
    vision_activations: int = 0
    """Of ``checkpointed_activations``, what the vision tower's patches keep on this rank (Note [vision tower
    memory]); its parameters are in ``parameters``."""
    mixer_state: int = 0
    """A hybrid's largest mixer layer's exchange buffers: the halos and state summaries its all-gathers hand this
    rank, held while the layer's backward runs (Note [hybrid memory]); a candidate for ``communication``."""
    mixer_exchange: int = 0
    """Bytes this rank sends in one step for a hybrid's mixers: every mixer layer's all-gathers and their
    reduce-scatters (Note [hybrid memory]); not memory, reported with it."""

    @property
    def step_peak(self) -> int:
        """Peak minus what lives between steps (``between_steps``): the growth one step adds."""
        return self.peak - self.between_steps

    def table(self) -> str:
        """A plain-text table of the categories in MiB, with the peak and the moment that sets it."""
        rows = [
            ("parameters", self.parameters),
            ("gradients", self.gradients),
            ("optimizer state", self.optimizer_state),
            ("checkpointed activations", self.checkpointed_activations),
            *([("  of which the vision tower's", self.vision_activations)] if self.vision_activations else []),
            ("layer transient", self.layer_transient),
            ("logits / loss", self.logits_loss),
            ("communication", self.communication),
            *([("pipeline receive buffers", self.pipeline_buffers)] if self.pipeline_buffers else []),
            (f"peak ({self.moment})", self.peak),
            ("step growth (peak - what lives between steps)", self.step_peak),
        ]
        if self.host:
            rows.append(("host memory (offloaded, not in the peak)", self.host))
        if self.mixer_exchange:
            rows.append(("mixer state exchange, one layer's buffers", self.mixer_state))
            rows.append(("mixer exchange sent per step (not in the peak)", self.mixer_exchange))
        offload = "; optimizer offloaded to the host" if self.offload_optimizer else ""
        head = (
            f"per-rank memory: {self.tokens_per_rank} tokens/rank, strategy {self.strategy}, "
            f"features: {', '.join(self.features) or 'none'}{offload}"
        )
        width = max(len(name) for name, _ in rows)
        return "\n".join([head, *(f"  {name:<{width}}  {value / _MB:10.1f} MiB" for name, value in rows)])
