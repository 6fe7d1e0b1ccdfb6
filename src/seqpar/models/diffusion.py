"""Where each diffusers transformer (a DiT) is sharded, gathered and attends: one declarative entry per class.

``DIFFUSION_PLANS`` is the registry ``seqpar.prepare_diffusers`` reads; ``register_diffusion_plan`` extends it.

Note [diffusion plans]
    A DiT turns latents into tokens (patchify), adds positions (RoPE from the frame x height x width grid),
    runs blocks of self-attention, cross-attention to the text and MLPs, and turns the tokens back into a
    latent (output projection, unpatchify). Only attention mixes tokens. An entry says, by module names:
    which inputs or outputs of which modules are cut along the sequence (``shards``: after patchify and the
    position tables, before the first block), which outputs are gathered back (``gathers``: the output
    projection, so unpatchify sees whole rows), which attention modules mix the sharded tokens
    (``self_attention``: served by seqpar) and which attend to the text (``cross_attention``: left local,
    this rank's queries against the whole text). Where the class declares diffusers' ``_cp_plan`` the
    entry leaves ``shards`` and ``gathers`` as None and the door reads that plan. A joint-attention model
    ([text; video] in one attention: CogVideoX, Flux) shards the text with the video (``joint_text``), so
    each text key is held by one rank and counted once, as in one process. A key mask over the joint
    sequence (HunyuanVideo's text padding, built over [video; text] before the blocks) is cut part by part
    (``JointSplit``), so each rank holds the mask of its own [video shard; text shard] keys, which the
    attention serves as a key-padding mask (Note [key-padding masks]). A class without an entry that declares
    ``_cp_plan`` gets a derived entry: that plan, its attention modules told apart per call (Note [derived
    attention]). One that declares none but is built as one list of blocks (lists named otherwise, text or
    noise refiners, run before the cut on every rank) followed by an output projection (``proj_out``, or
    ``proj_out_2``, ``final_layer``, ``out_layer``, ``final_linear``, ``norm_out`` where it has none) gets an entry
    derived from that structure: the tokens (the first block's ``hidden_states``) cut at the first block, each
    block's per-token tables (``TokenTables``) cut as it is called, the output projection's output gathered, which
    must then be this rank's shard of the tokens cut (a forward that drops tokens by a whole length between is
    refused; a class in ``DIFFUSION_TAILS`` is gathered at its last block instead, Note [gathered tail]). Where
    the blocks take the text and none of their attention modules is cross-attention, the blocks carry a joint
    [text; tokens] stream and
    the text is cut with the tokens; then double-stream blocks followed by single-stream ones (Flux's build)
    are read too, and a table over the joint sequence is cut part by part, the text first, as a joint
    attention orders its keys.

Note [derived attention]
    A derived entry names no attention patterns; every attention module of the model (diffusers'
    ``Attention`` or ``AttentionModuleMixin``) is judged by what its processor is given, as diffusers'
    own processors decide whether a call is context-parallel. A call inside the sharded region (after a
    planned cut, before the planned gather) without ``encoder_hidden_states``, or given its own tokens as
    them (Lumina's self-attention), is self-attention over the shards: served. With ``encoder_hidden_states``, a
    module that is not cross-attention (its ``is_cross_attention`` false, or, where it has no such flag,
    projections of the text's own: ``add_k_proj``, ``txt_attn_qkv``, a second query projection ``to_q_t``; or
    it sits in the single-stream blocks of a double- then single-stream build) is joint attention over [text;
    tokens]; one whose keys are projected from another width than its queries is cross-attention. Joint
    attention is served where the plan cuts the text too, refused where every rank holds
    it whole (its keys would count once per rank); cross-attention is local where the text is whole (this
    rank's queries, every key) and refused where the plan cuts the text (its queries and keys would be shards
    of different sequences); a module that says neither is refused. An SDPA call in the region from any
    other module is refused (seqpar cannot tell what it attends to). Calls outside the region (a text
    refiner before the cut) run as in one process. The first call fixes each module's judgement, so a
    recomputation in the backward (activation checkpointing), which runs outside the region's hooks,
    attends as the forward did. A key-padding mask that a processor broadcasts over heads and queries with
    ``expand`` (stride 0: the same row for each by construction) is served as its rows; a call given an argument
    that scales by the rank's share of the tokens (``DIFFUSION_REFUSED_ARGUMENTS``) is refused. What a module's
    names cannot tell, its row in ``seqpar.models.DIFFUSION_ATTENTION`` says (by its class or
    its processor's): cross or joint, the argument its text comes in, a whole text joined to its keys, a mask its
    processor builds (Note [gathered keys]); a module of another class with a row (Mochi's) is an attention
    module too.

Note [gathered tail]
    A plan may gather before the forward's end: a derived entry at its output projection, where a module with
    parameters may still run on the gathered output (Stable Audio's per-token ``postprocess_conv``), or at its last
    block where the forward computes per-token modulation, a long skip or a drop of the text by its whole length
    after the blocks (``DIFFUSION_TAILS``, or an entry's gathers); a ``_cp_plan`` that gathers inside each block
    (Helios). What runs after a gather runs on the same whole tokens on every rank, so each rank computes the whole
    gradient of everything it reaches, the parameters and the replicated tensors it reads from before the cut (the
    timestep embedding) alike, which the sum over the group (Note [replicated output]) would count once per rank.
    So at the end of a forward that gathered, the output's gradient is scaled by 1 / P (an identity whose backward
    scales), and that forward's gathers sum the gradient they receive over the group before handing back this
    rank's tokens' share (an all-gather's own backward, a reduce-scatter): every replicated part gets 1 / P of one
    process's gradient on every rank, which the sum makes exact, a parameter used both before the cut and after the
    gather included, and the sharded part its own tokens' whole gradient. The sum is what makes a gather inside the
    blocks exact (Helios' ``_cp_plan``: the gradient reaching it carries the later shards' own rows on each rank,
    not 1 / P of one replicated gradient; scaling this rank's rows by P instead would count those P times). It costs
    an all-reduce of each gathered tensor's gradient in the backward. Nothing is hooked inside the forward's own
    code, and every plan is served so, whether anything runs past its gathers or not (a registered entry cannot
    forget to say so). A tensor that differed across the ranks after a gather would break this; only the gathered
    tokens and what every rank holds alike meet there (the door's first check makes the model's arguments agree).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from seqpar.errors import SeqparInputError


@dataclass(frozen=True)
class Split:
    """One tensor cut along the sequence: diffusers' ``ContextParallelInput`` in seqpar's terms."""

    dim: int
    """The sequence dimension of the tensor."""
    ndim: int | None = None
    """Only a tensor with this many dimensions is cut (a per-sample timestep ``[B]`` passes whole, a per-token
    one ``[B, S]`` is cut); None: any."""
    output: bool = False
    """Cut the module's output at this index (the position tables a RoPE module returns) instead of an input."""


@dataclass(frozen=True)
class JointSplit:
    """A tensor over a joint sequence (the concatenation of ``parts`` in one process) cut part by part, so that
    this rank holds [part 0's shard; part 1's shard; ...], the order of its joint attention's keys."""

    dim: int
    """The joint sequence dimension of the tensor."""
    parts: tuple[str, ...] = ("hidden_states", "encoder_hidden_states")
    """The module's inputs (already cut, ``[B, S/P, ...]``) whose lengths make up the joint sequence, in order."""


@dataclass(frozen=True)
class FoldedSplit:
    """A tensor whose dimension ``dim`` folds the batch with the whole token sequence, batch-major (``[B * S, ...]``:
    Latte's per-position timesteps of its temporal blocks): cut along the tokens within each sample, as the tokens
    were cut (the length ``S`` read at the cut of ``hidden_states``)."""

    dim: int = 0


@dataclass(frozen=True)
class Gather:
    """One module output gathered back along the sequence: diffusers' ``ContextParallelOutput``."""

    dim: int
    ndim: int | None = None


@dataclass(frozen=True)
class TokenTables:
    """Every other tensor input of the module (nested in tuples, lists or dicts too: RoPE tables) with one
    dimension as long as the whole token sequence (per-token timesteps, position tables, key masks), or, where
    the plan cuts the text, as the whole text: cut along it."""


Entry = Mapping[str | int, Split | JointSplit | FoldedSplit | TokenTables | tuple[Split, ...]]


@dataclass(frozen=True)
class DiffusionPlan:
    """How one diffusers transformer class runs sequence-parallel (Note [diffusion plans])."""

    model: str
    """The class name (``type(model).__name__``)."""
    self_attention: str
    """Dotted pattern (each segment an ``fnmatch`` pattern of one name) of the attention modules that mix the
    sharded tokens."""
    cross_attention: str | None = None
    """Pattern of the attention modules whose keys are the text (left local); None: the model has none."""
    joint_text: bool = False
    """Self-attention holds the text too ([text; video]), sharded with the video."""
    shards: Mapping[str, Entry] | None = None
    """Module name (``""`` the model) -> input name or output index -> ``Split``; None: read ``_cp_plan``."""
    gathers: Mapping[str, tuple[Gather, ...]] | None = None
    """Module name -> one ``Gather`` per output; None: read ``_cp_plan``."""
    derived: bool = False
    """The entry was derived (from diffusers' ``_cp_plan`` or the structure); its attention modules are judged per
    call (Note [derived attention]), ``cross_attention`` is unused and ``self_attention`` names the single-stream
    block list, if any, whose attention modules are joint where they do not say."""
    refused: Mapping[str, str] = field(default_factory=dict)
    """Module class name -> why seqpar cannot serve a model holding one (a variant of the class)."""
    notes: tuple[str, ...] = field(default=())
    """What the entry was checked against (models and variants), for the guide."""


DIFFUSION_PLANS: dict[str, DiffusionPlan] = {
    plan.model: plan
    for plan in (
        DiffusionPlan(
            "WanTransformer3DModel",
            self_attention="blocks.*.attn1",
            cross_attention="blocks.*.attn2",
            notes=("Wan 2.1 / 2.2 (per-token timesteps), diffusers' _cp_plan",),
        ),
        DiffusionPlan(
            "WanVACETransformer3DModel",
            self_attention="*blocks.*.attn1",
            cross_attention="*blocks.*.attn2",
            # the forward hands every VACE block the whole patchified tokens (the first adds them to the control
            # stream, padded to their length), and the main blocks after them again: cut at each of those calls
            shards={
                "rope": {0: Split(1, 4, output=True), 1: Split(1, 4, output=True)},
                "vace_blocks.*": {"hidden_states": Split(1, 3)},
                "vace_blocks.0": {"control_hidden_states": Split(1, 3)},
                "blocks.0": {"hidden_states": Split(1, 3)},
            },
            gathers={"proj_out": (Gather(1, 3),)},
            notes=("Wan VACE: seqpar's plan (the control stream cut with the tokens, its hints added per shard)",),
        ),
        DiffusionPlan(
            "CogVideoXTransformer3DModel",
            self_attention="transformer_blocks.*.attn1",
            joint_text=True,
            shards={
                "transformer_blocks.0": {"hidden_states": Split(1, 3), "encoder_hidden_states": Split(1, 3)},
                "transformer_blocks.*": {"image_rotary_emb": (Split(0, 2), Split(0, 2))},
            },
            gathers={"proj_out": (Gather(1, 3),)},
            notes=("CogVideoX 1.0 / 1.5: seqpar's plan (diffusers declares none)",),
        ),
        DiffusionPlan(
            "LTXVideoTransformer3DModel",
            self_attention="transformer_blocks.*.attn1",
            cross_attention="transformer_blocks.*.attn2",
            # diffusers' _cp_plan also cuts the text and its mask, which seqpar's local cross-attention keeps
            # whole; per-token timesteps ([B, S], LTX-Video 0.9.5 and later) are cut with the tokens
            shards={
                "": {"hidden_states": Split(1, 3), "timestep": Split(1, 2)},
                "rope": {0: Split(1, 3, output=True), 1: Split(1, 3, output=True)},
            },
            gathers={"proj_out": (Gather(1, 3),)},
            notes=("LTX-Video: seqpar's plan (the text whole for the local cross-attention)",),
        ),
        DiffusionPlan(
            "HunyuanVideoTransformer3DModel",
            self_attention="*transformer_blocks.*.attn",
            joint_text=True,
            # the text refiner attends over the whole text on every rank, before the cut; the blocks' key mask
            # over [video; text] (text padding) is built in the model's forward and cut into each rank's keys
            shards={
                "transformer_blocks.0": {"hidden_states": Split(1, 3), "encoder_hidden_states": Split(1, 3)},
                "rope": {0: Split(0, 2, output=True), 1: Split(0, 2, output=True)},
                "*transformer_blocks.*": {"attention_mask": JointSplit(3)},
            },
            gathers={"proj_out": (Gather(1, 3),)},
            refused={
                block: "its first frame's tokens (token_replace image conditioning) are found by position in the "
                "block's local tokens"
                for block in (
                    "HunyuanVideoTokenReplaceTransformerBlock",
                    "HunyuanVideoTokenReplaceSingleTransformerBlock",
                )
            },
            notes=("HunyuanVideo (text-to-video, latent_concat image-to-video): seqpar's plan",),
        ),
        DiffusionPlan(
            "LatteTransformer3DModel",
            self_attention="transformer_blocks.*.attn1",
            cross_attention="transformer_blocks.*.attn2",
            # each frame's patches cut alike (the spatial blocks' rows are frames): a temporal block regroups the
            # tokens by patch position across frames, so this rank holds every frame of its positions and the
            # temporal attention runs locally on them; its per-position timesteps are cut as the positions were
            shards={
                "transformer_blocks.0": {"hidden_states": Split(1, 3)},
                "temporal_transformer_blocks.*": {"timestep": FoldedSplit(0)},
            },
            gathers={"proj_out": (Gather(1, 3),)},
            notes=("Latte: seqpar's plan (every frame cut by patch position; temporal attention local)",),
        ),
        DiffusionPlan(
            "ZImageTransformer2DModel",
            self_attention="layers.*.attention",
            # the main layers' one sequence [image; caption] (the refiners before run whole on every rank) cut as
            # one, with its RoPE table and padding mask; gathered at the final layer, before the forward drops the
            # caption by its whole length
            shards={
                "layers.0": {"x": Split(1, 3)},
                # the per-token noise mask of omni mode (noisy or clean modulation) too
                "layers.*": {"attn_mask": Split(1, 2), "freqs_cis": Split(1, 3), "noise_mask": Split(1, 2)},
                "all_final_layer.*": {"noise_mask": Split(1, 2)},
            },
            gathers={"all_final_layer.*": (Gather(1, 3),)},
            notes=("Z-Image (basic mode): seqpar's plan",),
        ),
        DiffusionPlan(
            "BriaFibo2Transformer2DModel",
            self_attention="layers.*.attention",
            cross_attention="layers.*.cross_attention",
            # the layers' one sequence [gist; image; context latents] (the noise refiner and the perceiver before
            # run whole on every rank) cut as one with its RoPE table, padding and noise masks; gathered after the
            # last layer, where the forward takes the image tokens out by their whole offsets
            shards={
                "layers.0": {"x": Split(1, 3)},
                "layers.*": {"attn_mask": Split(1, 2), "freqs_cis": Split(1, 3), "noise_mask": Split(1, 2)},
            },
            gathers={"layers.-1": (Gather(1, 3),)},
            notes=("Bria FIBO 2: seqpar's plan (gathered after the layers)",),
        ),
        DiffusionPlan(
            "ErnieImageTransformer2DModel",
            self_attention="layers.*.self_attention",
            # sequence-first [image; text] cut as one, with the per-token modulation, RoPE table and key mask;
            # gathered at the final projection, before the forward drops the text by its whole length
            shards={
                "layers.0": {"x": Split(0, 3)},
                "layers.*": {"rotary_pos_emb": Split(1, 4), "temb": (Split(0, 3),) * 6, "attention_mask": Split(3, 4)},
            },
            gathers={"final_linear": (Gather(0, 3),)},
            notes=("ERNIE-Image: seqpar's plan",),
        ),
        DiffusionPlan(
            "HunyuanVideoFramepackTransformer3DModel",
            self_attention="*transformer_blocks.*.attn",
            joint_text=True,
            # HunyuanVideo's joint blocks over [history latents; tokens] and the [image; text] condition, both cut;
            # gathered after the last block, where the forward drops the history by its whole length
            shards={
                "transformer_blocks.0": {"hidden_states": Split(1, 3), "encoder_hidden_states": Split(1, 3)},
                "*transformer_blocks.*": {
                    "image_rotary_emb": (Split(0, 2), Split(0, 2)),  # the single blocks' name of the RoPE table
                    "freqs_cis": (Split(0, 2), Split(0, 2)),  # the double blocks'
                    "attention_mask": JointSplit(3),
                },
            },
            gathers={"single_transformer_blocks.-1": (Gather(1, 3),)},
            notes=("HunyuanVideo Framepack: seqpar's plan (HunyuanVideo's, gathered after the blocks)",),
        ),
        *(
            DiffusionPlan(
                name,
                self_attention=f"{blocks}.*.{attention}",
                cross_attention=f"{blocks}.*.{cross}",
                # the tokens cut at the first block, its per-token tables as each block takes them; gathered at the
                # last block, after which the forward computes per-token values over the whole tokens
                shards={f"{blocks}.0": {"hidden_states": Split(1, 3)}, f"{blocks}.*": {"*": TokenTables()}},
                gathers={f"{blocks}.-1": (Gather(1, 3),)},
                notes=(f"{name}: seqpar's plan, gathered after the blocks ({after})",),
            )
            for name, blocks, attention, cross, after in (
                ("AnyFlowTransformer3DModel", "blocks", "attn1", "attn2", "output modulation per token"),
                ("LongCatAudioDiTTransformer", "blocks", "self_attn", "cross_attn", "a long skip connection"),
                (
                    "SanaWMLTX2RefinerTransformer3DModel",
                    "transformer_blocks",
                    "attn1",
                    "attn2",
                    "output modulation per token",
                ),
            )
        ),
        DiffusionPlan(
            "QwenImageTransformer2DModel",
            self_attention="transformer_blocks.*.attn",
            joint_text=True,
            notes=(
                "Qwen-Image: diffusers' _cp_plan (text, its padding mask and RoPE table cut with the image tokens)",
            ),
        ),
        DiffusionPlan(
            "FluxTransformer2DModel",
            self_attention="*transformer_blocks.*.attn",
            joint_text=True,
            notes=("Flux.1: diffusers' _cp_plan (text and image ids sharded with the tokens)",),
        ),
    )
}
"""The diffusers transformers ``seqpar.prepare_diffusers`` serves, by class name."""


DIFFUSION_TAILS: dict[str, str] = {
    "Krea2Transformer2DModel": "its drop of the text, joined before the tokens, by the text's whole length",
    "MiniMaxMusic3Transformer1DModel": "its drop of the timestep token, then a convolution over the whole sequence",
    "OmniGenTransformer2DModel": "its keep of the output image's tokens by their position from the end of the whole "
    "sequence (the prompt and the timestep token dropped)",
    "QwenImage21Transformer2DModel": "its output norm, which modulates each token by a mask over the whole joint "
    "sequence (the target image's rows)",
}
"""Class name -> what its forward computes over the whole tokens after its blocks: the plan derived from its
structure gathers at its last block's output, and the rest runs on every rank (Note [gathered tail])."""

DIFFUSION_REFUSALS: dict[str, str] = {
    "CosmosTransformer3DModel": "its blocks take the timestep embedding per token in two tensors of different "
    "layouts, which a plan derived from its structure does not cut alike",
    "MiniMaxH3Transformer3DModel": "text, video and audio rows are packed into one sequence by index, and under "
    "diffusers' _cp_plan the text refiner's gradients are not one process's",
    "ConsisIDTransformer3DModel": "its identity path (a local facial extractor whose embeddings a perceiver "
    "cross-attention reads after every block) is not proven exact: gathered after the blocks (Note [gathered tail]), "
    "the extractor's last gradient, which cancels to 1e-6 of the model's, lands 1.02x past the DiT sweep's floor "
    "bound at sp 2 ring (2.8x under allgather; within it at sp 3 ring and under Ulysses): rounding, or a fault "
    "too small to tell from it",
    "Flux3Transformer2DModel": "its single-stream blocks take one content stream that its forward joins from the "
    "image tokens and the image-condition tokens after their own mode blocks, and drops the condition by the image's "
    "whole length: seqpar cuts and gathers one stream of a joint sequence as one, not part by part",
    "BriaFiboTransformer2DModel": "its forward joins each single-stream block's text with another text-encoder "
    "layer's whole features between the blocks",
    "HiDreamImageTransformer2DModel": "its forward joins each block's text with another text-encoder layer's whole "
    "features between the blocks, and drops them by their whole length",
    **{
        conv: "its feed-forward reshapes the block's tokens into the whole height x width grid and runs a depthwise "
        "3 x 3 convolution over it, which mixes neighbouring tokens across the ranks' shards (seqpar has no halo "
        "exchange)"
        for conv in ("GLUMBConv", "GLUMBTempConv")
    },
    "StableAudio3DiTModel": "each block adds the inpainting conditioning to the tokens after the first "
    "num_memory_tokens positions of its own tokens, and its forward drops the memory tokens by position",
    "WanAnimateFaceBlockCrossAttention": "the face adapter attends each frame's tokens to that frame's motion "
    "vector, found by reshaping the block's local tokens into frames",
}
"""Module class name -> why seqpar refuses a diffusers model holding one (what its structure does not tell)."""

DIFFUSION_REFUSED_ARGUMENTS: dict[str, str] = {
    "base_sequence_length": "proportional attention (Lumina's): the softmax scale is the log of the queries a call "
    "holds, a rank's share of the tokens, to the base length",
}
"""Keyword argument of an attention call over the shards -> why seqpar refuses a call given it."""


def register_diffusion_plan(plan: DiffusionPlan) -> DiffusionPlan:
    """Add (or replace) the entry of one diffusers transformer class.

    Args:
        plan: the entry; ``plan.model`` is the class name it is for.

    Returns:
        The entry.

    Raises:
        SeqparInputError: an entry without a self-attention pattern.
    """
    if not plan.self_attention:
        raise SeqparInputError(f"the diffusion plan of {plan.model} names no self-attention modules")
    DIFFUSION_PLANS[plan.model] = plan
    return plan
