"""One rank's memory during a training step, from the model's sizes and what the rank holds of a pipeline.

``seqpar.memory.estimate`` checks the settings and asks this for each rank it reports (Note [memory estimate]).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

from seqpar.gradients import BUCKET_MB
from seqpar.memory.activations import activation_bytes, comm_elements
from seqpar.memory.mixers import exchange_bytes
from seqpar.memory.pipeline import StageView, held_logits_bytes
from seqpar.memory.result import MemoryEstimate
from seqpar.models import ModelSizes, parameter_counts

OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0}
"""Optimizer states per parameter."""
_MB = 2**20


@functools.lru_cache(maxsize=256)
def _stage_sizes(d: ModelSizes, layers: int) -> ModelSizes:
    """``d`` with ``layers`` decoder layers; memoised, since the planner asks for the same few stages often."""
    return d if layers == d.num_hidden_layers else dataclasses.replace(d, num_hidden_layers=layers)


def _peak_candidates(layers: int, grows: int, shards: int, freed: float) -> Sequence[int]:
    """The layers of the backward among which the largest ``during(done)`` of ``estimate_rank`` lies.

    Layer by layer, the gradients in flight rise by ``grows // shards`` or one more (the floor of a multiple) and
    the kept activations fall by ``freed``. When the sum can only rise, the last layer holds the most (its
    gradients too, so it also wins ties); when it can only fall, the first does. Only when the floor's rounding
    decides the sign is every layer a candidate. The planner asks this for thousands of layouts: one or two
    evaluations instead of one per layer.

    Args:
        layers: decoder layers of the rank.
        grows: gradient bytes each layer's backward adds before sharding (0: the gradients held do not grow).
        shards: ranks the gradients are sharded over.
        freed: kept activation bytes each layer's backward frees.

    Returns:
        The ``done`` indices to evaluate.
    """
    if layers == 0:
        return ()
    least, rounded = divmod(grows, shards)
    if least >= freed:
        return (layers - 1,)
    if least + (rounded > 0) < freed:
        return (0,)
    return range(layers)


def estimate_rank(
    d: ModelSizes,
    view: StageView,
    pipelined: bool,
    *,
    chosen: str,
    b: int,
    tokens: int,
    features: tuple[str, ...],
    sizes: dict,
    dp_mode: str,
    loss_chunk: int,
    mlp_chunk: int,
    optimizer: str,
    keep_gradients: bool,
    offload_optimizer: bool,
    vision: tuple[int, int] = (0, 0),
    rows: int = 1,
) -> MemoryEstimate:
    """One rank's estimate (Note [memory estimate] in ``seqpar.memory.estimate``).

    Args:
        d: the model's sizes (after tp).
        view: which layers and ends of a pipeline the rank holds, and what the schedule keeps in flight.
        pipelined: whether there is a pipeline (pp > 1).
        chosen: the attention strategy.
        b: bytes per element.
        tokens: tokens of one micro-batch on this rank.
        features: memory features on.
        sizes: sp_size, ulysses_size, dp_size, tp_size.
        dp_mode: "replicate", "ddp" or "fsdp".
        loss_chunk: tokens per piece of the chunked loss.
        mlp_chunk: tokens per chunk of the tiled MLP.
        optimizer: a key of ``OPTIMIZER_STATES``.
        keep_gradients: gradients live between steps.
        offload_optimizer: parameters, gradients and state in host memory.
        vision: the vision tower's (parameters, activation bytes kept on this rank): Note [vision tower memory].
        rows: rows of one micro-batch (a hybrid's mixers exchange per row and chunk, Note [hybrid memory]).

    Returns:
        The rank's ``MemoryEstimate``.
    """
    sp_size, ulysses_size, dp_size = sizes["sp_size"], sizes["ulysses_size"], sizes["dp_size"]
    d = _stage_sizes(d, view.layers)  # a pipeline rank holds its stage's layers
    layers, tied, hidden, vocab = d.num_hidden_layers, d.tie_word_embeddings, d.hidden_size, d.vocab_size
    total, layer_params, head_params = parameter_counts(d)
    # a pipeline's end rank holds one end of the model: the embedding (first rank) or the norm and head (last)
    total += vision[0] - (head_params if pipelined and not tied else 0)
    shards = dp_size * sp_size if dp_mode == "fsdp" else 1
    params = -(-total * b // shards) + (2 * layer_params * b if shards > 1 else 0)  # fsdp: one layer gathered
    states = OPTIMIZER_STATES[optimizer] * -(-total * b // shards)
    act = activation_bytes(d, tokens, b, features, mlp_chunk, sp_size)
    state, sent = _mixer_exchange(d, sp_size, rows, b)
    if act["kept_layers"] == layers:  # offloaded checkpoints wait on the host, whichever micro-batch they are
        act["kept"] = int(act["kept"] * view.in_flight)  # Note [pipeline memory and time]
    comm = max(int(comm_elements(chosen, d, sp_size, ulysses_size) * tokens * b), state)
    chunk = min(loss_chunk, tokens) if "chunked_loss" in features else tokens
    loss = (3 * chunk * vocab * 4 + (tokens * hidden * b if "chunked_loss" in features else 0)) * view.last
    # Note [pipeline memory and time]: torch's receive buffers, one per micro-batch and stage boundary, kept
    recv = view.recv_buffers * tokens * hidden * b if pipelined else 0
    act["kept"] += view.sends_held * tokens * hidden * b + vision[1]  # interleaved: sends held to the step's end
    # Note [pipeline memory and time]: torch's last stage keeps outputs until their backward
    held_logits = held_logits_bytes(view, tokens, vocab, b) if pipelined and "chunked_loss" not in features else 0
    head_grad, all_grads = head_params * b // shards, -(-total * b // shards)
    kept_grads = all_grads if keep_gradients else 0
    host = (layers - act["kept_layers"]) * act["kept_per_layer"] * view.in_flight  # inputs the offload moved
    gathered_head = 0
    if offload_optimizer:  # Note [memory estimate], optimizer offload: only working copies on the device
        units = 0 if tied else 2 * head_params  # embedding and head are units of their own unless tied
        params = (total - units - layers * layer_params + 2 * layer_params) * b  # the root, two blocks
        gathered_head = units // 2 * b  # from the head's forward through its backward
        host += (2 + OPTIMIZER_STATES[optimizer]) * 4 * -(-total // shards)  # fp32 master, gradients, states
        states = all_grads = kept_grads = 0
        head_grad = head_params * b if tied else 0  # a root's gradients wait for the end of the backward
    # chunked: the output head's gradient accumulates in its own buffer from the first piece's backward on
    early = (head_grad or gathered_head) if "chunked_loss" in features else 0
    moments = {"backward start": (kept_grads + early, act["kept"], 0, loss + held_logits, 0, 0)}
    freed = act["kept_per_layer"] * (act["kept_layers"] == layers)  # kept activations each layer's backward frees

    def during(done: int) -> tuple[int, int]:
        """(gradients + kept activations, gradients) in the backward of the (done+1)-th layer from the top."""
        in_flight = 2 * layer_params * b if offload_optimizer else (done + 1) * layer_params * b // shards
        grads = kept_grads or head_grad + in_flight
        return grads + act["kept"] - done * freed, grads

    grows = 0 if offload_optimizer or kept_grads else layer_params * b  # per layer, before the // shards
    worst = max([(0, 0), *(during(done) for done in _peak_candidates(layers, grows, shards, freed))])
    # the attention's buffers live while its backward runs, after the MLP's tensors of the layer are freed
    mlp_moment = act["recomputed"] + act["extra"]
    attention_first = mlp_moment < act["recomputed_attention"] + comm
    transient, comm = (act["recomputed_attention"], comm) if attention_first else (mlp_moment, 0)
    moments["layer backward"] = (worst[1], worst[0] - worst[1], transient, held_logits, comm, 0)
    if dp_mode == "replicate" and dp_size * sp_size > 1:
        bucket = min(all_grads, int(BUCKET_MB * _MB))
        moments["gradient all-reduce"] = (all_grads, 0, 0, 0, bucket, 0)
    largest = max(head_params, layer_params // 3) * b // shards  # AdamW updates tensor by tensor on the CPU
    if not offload_optimizer:  # offloaded, the update runs on the host
        moments["optimizer"] = (all_grads, 0, 0, 0, 0, 2 * largest if states else 0)
    on_device = {m: params + (gathered_head if m == "backward start" else 0) for m in moments}
    moment = max(moments, key=lambda m: on_device[m] + sum(moments[m]))
    g, kept, trans, logits, comm_at, opt_tmp = moments[moment]
    return MemoryEstimate(
        parameters=on_device[moment],
        gradients=g,
        optimizer_state=states + opt_tmp,
        checkpointed_activations=kept,
        layer_transient=trans,
        logits_loss=logits,
        communication=comm_at,
        peak=on_device[moment] + states + sum(moments[moment]) + recv,
        moment=moment,
        between_steps=(0 if offload_optimizer else params + states + kept_grads) + recv,
        tokens_per_rank=tokens,
        strategy=chosen,
        features=features,
        host=int(host),
        offload_optimizer=offload_optimizer,
        pipeline_buffers=recv,
        vision_activations=vision[1],
        mixer_state=state,
        mixer_exchange=sent,
    )


def _mixer_exchange(d: ModelSizes, sp_size: int, rows: int, b: int) -> tuple[int, int]:
    """(the largest mixer layer's gathered halos and state summaries, the bytes all mixer layers send in a step)
    on one rank, under the zigzag layout (two chunks a rank; Note [hybrid memory])."""
    if sp_size == 1 or not d.hybrid:
        return 0, 0
    held, sent = 0, 0
    for kind, layers in d.kind_counts.items():
        halo, summaries = exchange_bytes(d, kind, rows, 2, b)
        held = max(held, sp_size * (halo + summaries))
        sent += layers * 2 * (sp_size - 1) * (halo + summaries)  # the all-gather and its reduce-scatter
    return held, sent
