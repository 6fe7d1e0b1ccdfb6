"""Cutting a Hugging Face causal language model into pipeline stages: the parts, the balanced split, the stages.

``split_model`` finds the embedding, decoder layers, final norm and head, and builds this rank's stage modules.

Note [pipeline stages]
    A causal LM ``model`` (its decoder with the embedding, layers, final norm and rotary embedding, and the
    head, wherever its family's entry puts them: Note [model families]) is cut into
    ``S = pp_size * stages_per_rank`` stages; stage ``s`` runs on pp rank ``s % pp_size`` (the looped
    placement torch's interleaved schedules expect). The layers are cut into
    contiguous runs of at least one layer each, choosing the cut that makes the largest stage (in parameters)
    smallest, where the first stage also counts the input embedding and the last the final norm and head.
    Each stage is a ``DecoderStage`` whose ``model`` is a copy of the decoder's *frame* only: the copy shares
    (does not copy) this stage's layers, the rotary embedding and, on the first stage, the embedding; the
    other layers are left out, the embedding is None on later stages, and the final norm is an identity on
    earlier ones. Its config is a copy whose ``layer_types`` are this stage's slice, so a family that
    indexes per-layer settings by the position in ``layers`` (Qwen2/3, Gemma 3) reads the right ones.
    The decoder's own forward therefore runs each stage: the embedding on the first (``input_ids``),
    ``inputs_embeds`` on the others, RoPE recomputed on every stage from the ``position_ids`` that every
    stage receives with each micro-batch (global, packed-document ids from ``seqpar.shard_batch``, never
    sent between stages), and the forward hook of ``seqpar.prepare_model`` (copied with the frame) builds
    the sequence mask of the micro-batch over the SP group and hands seqpar's attention its context, as
    for the whole model (Note [transformers integration]); the frames keep the hook they were copied with,
    so choose the strategy and layout in ``prepare_model`` before splitting. Tied embeddings: the head's
    weight is the embedding's, which lives on the first stage; the last stage (on another rank) holds a
    copy, and after the step the two gradients are summed between those two ranks (Megatron's embedding
    group), so both copies take the same update; the gradient norm counts the weight once (Note [pipeline
    loss]).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from seqpar.models import find_anatomy


@dataclass(frozen=True)
class ModelParts:
    """The pieces of a causal LM that pipeline stages are made of."""

    decoder: nn.Module
    """The decoder (``model.model``): its forward takes ``input_ids`` or ``inputs_embeds`` and ``position_ids``."""
    embedding: nn.Module
    layers: list[nn.Module]
    norm: nn.Module
    rotary: nn.Module
    head: nn.Linear
    softcap: float | None
    """The final logit soft-capping (Gemma), applied after the head as the model's own forward does."""
    names: tuple[str, str]
    """The decoder's and the head's names in the model (for the parameters' original names)."""
    paths: tuple[str, str] = ("embed_tokens", "layers")
    """The embedding's and the layer list's paths inside the decoder (its family's entry)."""

    @property
    def tied(self) -> bool:
        """Whether the head's weight is the embedding's."""
        return self.head.weight is getattr(self.embedding, "weight", None)


def find_parts(model: nn.Module) -> ModelParts | str:
    """The parts of ``model``, or the reason they cannot be found (a string; the caller raises on every rank).

    Args:
        model: a transformers causal LM of a registered family (``seqpar.models.FAMILIES``).

    Returns:
        The ``ModelParts``, or a sentence naming what is missing.
    """
    name = type(model).__name__
    found = find_anatomy(model)
    if isinstance(found, str):
        return f"the decoder layers of {name} cannot be found: {found}"
    decoder, rotary, head = found.decoder, found.rotary, found.head
    if decoder is model:
        return f"{name} has no separate decoder module (a model with a head is cut into stages)"
    missing = [what for what, part in (("a final norm", found.norm), ("a rotary embedding", rotary)) if part is None]
    if not isinstance(head, nn.Linear):
        missing.append("a linear output head")
    if missing:
        return f"the decoder layers of {name} cannot be found: its decoder lacks {', '.join(missing)}"
    config = model.config
    for attr in ("logit_scale", "logits_scaling"):
        if getattr(config, attr, None) not in (None, 1, 1.0):
            return f"{name} scales its logits ({attr}), which the pipeline's last stage does not reproduce"
    placed = {id(p) for m in (found.embedding, found.norm, rotary, head, *found.layers) for p in m.parameters()}
    others = [n for n, p in model.named_parameters() if id(p) not in placed]
    if others:
        return f"{name} has parameters outside its embedding, layers, norm and head ({', '.join(others[:3])})"
    inside = {id(m): n for n, m in decoder.named_modules()}
    return ModelParts(
        names=(found.name(decoder), found.name(head)),
        decoder=decoder,
        embedding=found.embedding,
        layers=list(found.layers),
        norm=found.norm,
        rotary=rotary,
        head=head,
        softcap=getattr(config, "final_logit_softcapping", None),
        paths=(inside[id(found.embedding)], inside[id(found.layers)]),
    )


class DecoderStage(nn.Module):
    """One pipeline stage of a causal LM (Note [pipeline stages]): its decoder frame, and the head when last.

    ``forward(x, position_ids)``: ``x`` is ``input_ids`` ``[b, s]`` on the first stage and the hidden states
    ``[b, s, hidden]`` elsewhere; it returns hidden states, or on the last stage the logits (or the final
    hidden states when the loss makes the logits itself, in pieces).
    """

    def __init__(
        self,
        model: nn.Module,
        lm_head: nn.Module | None,
        *,
        index: int,
        first_layer: int,
        first: bool,
        last: bool,
        softcap: float | None,
        return_hidden: bool,
        names: tuple[str, str],
        paths: tuple[str, str] = ("embed_tokens", "layers"),
    ) -> None:
        super().__init__()
        self.model = model
        self.lm_head = lm_head
        self.index, self.first_layer, self.first, self.last = index, first_layer, first, last
        self.softcap, self.return_hidden = softcap, return_hidden
        self.names, self.paths = names, paths

    def get_input_embeddings(self) -> nn.Module | None:
        """The input embedding (first stage), else None."""
        return self.model.get_submodule(self.paths[0]) if self.first else None

    def get_output_embeddings(self) -> nn.Module | None:
        """The output head (last stage), else None."""
        return self.lm_head

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        key = "input_ids" if self.first else "inputs_embeds"
        hidden = self.model(**{key: x}, position_ids=position_ids).last_hidden_state
        if not self.last or self.return_hidden:
            return hidden
        logits = self.lm_head(hidden)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def _stage_config(config: object, start: int, end: int) -> object:
    """A copy of the decoder's config whose per-layer lists cover layers ``start..end-1`` only."""
    config = copy.deepcopy(config)
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, list | tuple) and len(layer_types) == getattr(config, "num_hidden_layers", None):
        config.layer_types = list(layer_types[start:end])
        config.num_hidden_layers = end - start
    return config


def _frame(parts: ModelParts, start: int, end: int, first: bool, last: bool) -> nn.Module:
    """A copy of the decoder that shares layers ``start..end-1`` (and the stage's other parts) instead of copying."""
    decoder = parts.decoder
    memo = {
        id(decoder.get_submodule(parts.paths[1])): nn.ModuleList(parts.layers[start:end]),
        id(parts.embedding): parts.embedding if first else None,
        id(parts.norm): parts.norm if last else nn.Identity(),
        id(parts.rotary): parts.rotary,
        id(decoder.config): _stage_config(decoder.config, start, end),
    }
    return copy.deepcopy(decoder, memo)


def split_model(
    parts: ModelParts, counts: list[int], stage_indices: list[int], *, return_hidden: bool
) -> list[DecoderStage]:
    """This rank's stage modules (Note [pipeline stages]).

    Args:
        parts: from ``find_parts(model)``.
        counts: layers per stage (``balanced_split``).
        stage_indices: the stages this rank runs.
        return_hidden: the last stage returns the final hidden states instead of logits.

    Returns:
        One ``DecoderStage`` per index. They share the model's parameters; the last stage holds a copy of
        the head when the head is tied to the embedding and the first stage runs elsewhere.

    """
    starts = [sum(counts[:s]) for s in range(len(counts))]
    stages = []
    for s in stage_indices:
        first, last = s == 0, s == len(counts) - 1
        head = None
        if last:
            head = copy.deepcopy(parts.head) if parts.tied and not first else parts.head
        frame = _frame(parts, starts[s], starts[s] + counts[s], first, last)
        stage = DecoderStage(
            frame,
            head,
            index=s,
            first_layer=starts[s],
            first=first,
            last=last,
            softcap=parts.softcap,
            return_hidden=return_hidden,
            names=parts.names,
            paths=parts.paths,
        )
        stages.append(stage)
    return stages


def original_names(stage: DecoderStage) -> Iterator[tuple[str, nn.Parameter]]:
    """The stage's parameters under their names in the model it was cut from (a tied head's copy as the head).

    Read from the stage's modules each time, so it holds after FSDP2 replaced them with sharded ones.

    Args:
        stage: one of ``split_model``'s stages.

    Returns:
        ``(name, parameter)`` pairs, each parameter once.
    """
    decoder, head = stage.names
    layers = f"model.{stage.paths[1]}."
    for name, p in stage.named_parameters():
        if name.startswith(layers):
            index, rest = name[len(layers) :].split(".", 1)
            yield f"{decoder}.{stage.paths[1]}.{stage.first_layer + int(index)}.{rest}", p
        elif name.startswith("model."):
            yield f"{decoder}.{name[len('model.') :]}", p
        else:
            yield f"{head}.{name[len('lm_head.') :]}", p
