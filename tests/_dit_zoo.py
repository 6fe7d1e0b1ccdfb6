"""Tiny builds of every transformer class of the installed diffusers and a batch for each: the DiT zoo sweep's models.

The configurations are diffusers' own tests' (tests/models/transformers, tests/pipelines), adapted so the tokens divide.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

_TEXT = 24  # text tokens: 2P equal chunks for P = 2, 3, 4


@dataclass(frozen=True)
class DitSpec:
    """One class's tiny build and batch."""

    config: dict
    """The constructor's keyword arguments."""
    inputs: Callable[[torch.Generator], dict]
    """The forward's keyword arguments (without return_dict), tensors drawn from the generator."""
    output: int = 0
    """The index of the prediction in ``model(**inputs, return_dict=False)``."""


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=gen)


def _step(gen: torch.Generator, batch: int = 1) -> torch.Tensor:
    """A timestep in [0, 1000), as float."""
    return torch.randint(0, 1000, (batch,), generator=gen).float()


def _text(gen: torch.Generator, dim: int, tokens: int = _TEXT, batch: int = 1) -> torch.Tensor:
    return torch.randn(batch, tokens, dim, generator=gen)


def _video(gen: torch.Generator, channels: int, frames: int, height: int, width: int) -> torch.Tensor:
    """A [1, C, F, H, W] latent."""
    return torch.randn(1, channels, frames, height, width, generator=gen)


def _image(gen: torch.Generator, channels: int, height: int, width: int, batch: int = 1) -> torch.Tensor:
    return torch.randn(batch, channels, height, width, generator=gen)


_WAN = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=12,
    in_channels=4,
    out_channels=4,
    text_dim=16,
    freq_dim=32,
    ffn_dim=32,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    rope_max_seq_len=32,
)


def _wan_inputs(gen: torch.Generator, channels: int = 4, text_dim: int = 16) -> dict:
    """2 frames of 12 x 12 latents: 2 x 6 x 6 = 72 tokens."""
    return dict(
        hidden_states=_video(gen, channels, 2, 12, 12), timestep=_step(gen), encoder_hidden_states=_text(gen, text_dim)
    )


def _helios_inputs(gen: torch.Generator) -> dict:
    """A 24 x 16 latent: 2 x 12 x 8 = 192 tokens, the short history 96, the mid and long histories (patches of
    2 x 4 x 4 and 4 x 8 x 8) 24 each."""
    return dict(
        hidden_states=_video(gen, 4, 2, 24, 16),
        timestep=_step(gen),
        encoder_hidden_states=_text(gen, 16),
        indices_hidden_states=torch.tensor([[19.0, 20.0]]),
        indices_latents_history_short=torch.tensor([[18.0]]),
        indices_latents_history_mid=torch.arange(16.0, 18.0)[None],
        indices_latents_history_long=torch.arange(0.0, 16.0)[None],
        latents_history_short=_video(gen, 4, 1, 24, 16),
        latents_history_mid=_video(gen, 4, 2, 24, 16),
        latents_history_long=_video(gen, 4, 16, 24, 16),
    )


def _wan_animate_inputs(gen: torch.Generator) -> dict:
    """3 frames of 12 x 16 latents (144 tokens); 5 face frames, which the face encoder's two stride-2 convolutions
    bring to the 2 pose frames."""
    return dict(
        hidden_states=_video(gen, 12, 3, 12, 16),
        timestep=_step(gen),
        encoder_hidden_states=_text(gen, 16),
        encoder_hidden_states_image=_text(gen, 16),
        pose_hidden_states=_video(gen, 4, 2, 12, 16),
        face_pixel_values=_video(gen, 3, 5, 16, 16),
    )


def _grid_ids(height: int, width: int, axes: int = 3) -> torch.Tensor:
    """Position ids (0, h, w[, 0]) of a height x width grid of packed latent tokens: [H * W, axes]."""
    ids = torch.zeros(height * width, axes)
    ids[:, 1] = torch.arange(height).repeat_interleave(width)
    ids[:, 2] = torch.arange(width).repeat(height)
    return ids


def _text_ids(axes: int = 3) -> torch.Tensor:
    """Text position ids: zeros, the last axis counting the tokens where there are four (Flux 2)."""
    ids = torch.zeros(_TEXT, axes)
    if axes == 4:
        ids[:, 3] = torch.arange(_TEXT)
    return ids


def _flux_inputs(gen: torch.Generator, channels: int = 4, text_dim: int = 32) -> dict:
    """6 x 8 packed latent tokens (48)."""
    return dict(
        hidden_states=_randn(gen, 1, 48, channels),
        encoder_hidden_states=_text(gen, text_dim),
        timestep=torch.rand(1, generator=gen),
        img_ids=_grid_ids(6, 8),
        txt_ids=_text_ids(),
    )


def _flux2_inputs(gen: torch.Generator) -> dict:
    return dict(
        hidden_states=_randn(gen, 1, 48, 4),
        encoder_hidden_states=_text(gen, 32),
        timestep=torch.rand(1, generator=gen),
        img_ids=_grid_ids(6, 8, 4)[None],
        txt_ids=_text_ids(4)[None],
        guidance=torch.tensor([3.5]),
    )


def _flux3_inputs(gen: torch.Generator) -> dict:
    """48 image tokens and a 48-token reference image (at t = 1 in its ids)."""
    cond_ids = _grid_ids(6, 8, 4)
    cond_ids[:, 0] = 1
    return dict(
        hidden_states=_randn(gen, 1, 48, 4),
        encoder_hidden_states=_text(gen, 32),
        timestep=torch.rand(1, generator=gen),
        img_ids=_grid_ids(6, 8, 4),
        txt_ids=_text_ids(4),
        image_cond_hidden_states=_randn(gen, 1, 48, 4),
        image_cond_ids=cond_ids,
    )


def _bria_fibo_inputs(gen: torch.Generator) -> dict:
    text = _text(gen, 64)
    return _flux_inputs(gen, 48, 64) | dict(encoder_hidden_states=text, text_encoder_layers=[text[..., :32]] * 2)


def _qwen_inputs(gen: torch.Generator, channels: int = 16) -> dict:
    """6 x 8 packed 2 x 2 patches (48 tokens), the last 4 text tokens padding."""
    mask = torch.ones(1, _TEXT, dtype=torch.long)
    mask[:, -4:] = 0
    return dict(
        hidden_states=_randn(gen, 1, 48, channels),
        encoder_hidden_states=_text(gen, 16),
        encoder_hidden_states_mask=mask,
        timestep=torch.rand(1, generator=gen),
        img_shapes=[(1, 6, 8)],
    )


def _qwen21_inputs(gen: torch.Generator) -> dict:
    """The prompt's 24 tokens, then one slot per 2 x 2 group of the 6 x 8 target latent tokens (48)."""
    img_mask = torch.cat([torch.zeros(1, _TEXT, dtype=torch.bool), torch.ones(1, 12, dtype=torch.bool)], dim=1)
    return dict(
        hidden_states=_randn(gen, 1, 48, 4),
        encoder_hidden_states=_text(gen, 16),
        timestep=torch.rand(1, generator=gen),
        img_shapes=[[(1, 6, 8)]],
        img_mask=img_mask,
        encoder_hidden_states_mask=torch.ones(1, _TEXT, dtype=torch.bool),
    )


def _hidream_inputs(gen: torch.Generator) -> dict:
    """A square 24 x 24 latent in 2 x 2 patches (144 tokens: a non-square one is padded to max_resolution); two
    Llama layers' text states."""
    return dict(
        hidden_states=_image(gen, 4, 24, 24),
        timesteps=_step(gen),
        encoder_hidden_states_t5=_text(gen, 8),
        encoder_hidden_states_llama3=torch.randn(2, 1, _TEXT, 4, generator=gen),
        pooled_embeds=_randn(gen, 1, 8),
    )


def _sizes() -> dict:
    """CogView's micro-conditions of a 12 x 16 latent (96 x 128 pixels)."""
    return dict(
        original_size=torch.tensor([[96, 128]]),
        target_size=torch.tensor([[96, 128]]),
        crop_coords=torch.tensor([[0, 0]]),
    )


def _hunyuan_dit_inputs(gen: torch.Generator) -> dict:
    from diffusers.models.embeddings import get_2d_rotary_pos_embed

    return dict(
        hidden_states=_image(gen, 4, 12, 16),
        timestep=_step(gen),
        encoder_hidden_states=_text(gen, 8),
        text_embedding_mask=torch.ones(1, _TEXT),
        encoder_hidden_states_t5=_text(gen, 8),
        text_embedding_mask_t5=torch.ones(1, _TEXT),
        image_meta_size=torch.tensor([[1024.0, 1024.0, 96.0, 128.0, 0.0, 0.0]]),
        style=torch.zeros(1, dtype=torch.long),
        image_rotary_emb=get_2d_rotary_pos_embed(8, ((0, 0), (6, 8)), (6, 8)),
    )


def _lumina_next_inputs(gen: torch.Generator) -> dict:
    from diffusers.models.embeddings import get_2d_rotary_pos_embed_lumina

    return dict(
        hidden_states=_image(gen, 4, 12, 16),
        timestep=torch.rand(1, generator=gen),
        encoder_hidden_states=_text(gen, 32),
        encoder_mask=torch.ones(1, _TEXT),
        image_rotary_emb=get_2d_rotary_pos_embed_lumina(8, 32, 32),
        cross_attention_kwargs={},
    )


def _omnigen_inputs(gen: torch.Generator) -> dict:
    """47 prompt tokens, 24 of them an input image's 4 x 6 patches, then the timestep token and the 6 x 8 output
    patches: 96 in all, masked as the pipeline's processor masks them."""
    prompt, length = 47, 47 + 1 + 48
    mask = torch.tril(torch.ones(length, length))  # the prompt and the timestep token attend causally,
    mask[prompt + 1 :] = 1  # the output image's tokens to everything,
    mask[1:25, 1:25] = 1  # the input image's tokens to one another
    return dict(
        hidden_states=_image(gen, 4, 12, 16),
        timestep=torch.rand(1, generator=gen),
        input_ids=torch.randint(0, 10, (1, prompt), generator=gen),
        input_img_latents=[_image(gen, 4, 8, 12)],
        input_image_sizes={0: [[1, 25]]},
        attention_mask=mask[None],
        position_ids=torch.arange(length)[None],
    )


def _z_image_inputs(gen: torch.Generator) -> dict:
    """A 16 x 24 latent in 2 x 2 patches and 96 caption tokens: Z-Image pads both to a multiple of 32 tokens."""
    return dict(x=[_randn(gen, 16, 1, 16, 24)], t=torch.rand(1, generator=gen), cap_feats=[_randn(gen, 96, 16)])


def _krea2_inputs(gen: torch.Generator) -> dict:
    """24 text tokens (the last one padding), then the 6 x 8 image tokens."""
    ids = torch.cat([torch.zeros(_TEXT, 3), _grid_ids(6, 8)])
    mask = torch.ones(1, _TEXT, dtype=torch.bool)
    mask[:, -1] = False
    return dict(
        hidden_states=_randn(gen, 1, 48, 16),
        encoder_hidden_states=torch.randn(1, _TEXT, 3, 16, generator=gen),
        timestep=torch.rand(1, generator=gen),
        position_ids=ids,
        encoder_attention_mask=mask,
    )


def _ideogram4_inputs(gen: torch.Generator) -> dict:
    """One packed sequence: 24 text tokens, then 6 x 8 image tokens."""
    from diffusers.models.transformers.transformer_ideogram4 import (
        IMAGE_POSITION_OFFSET,
        LLM_TOKEN_INDICATOR,
        OUTPUT_IMAGE_INDICATOR,
    )

    image = 48
    length = _TEXT + image
    hidden_states = torch.zeros(1, length, 16)
    hidden_states[:, _TEXT:] = _randn(gen, 1, image, 16)
    encoder_hidden_states = torch.zeros(1, length, 24)
    encoder_hidden_states[:, :_TEXT] = _text(gen, 24)
    position_ids = torch.zeros(1, length, 3, dtype=torch.long)
    position_ids[:, :_TEXT] = torch.arange(_TEXT)[:, None]
    position_ids[:, _TEXT:] = _grid_ids(6, 8).long() + IMAGE_POSITION_OFFSET
    indicator = torch.full((1, length), OUTPUT_IMAGE_INDICATOR)
    indicator[:, :_TEXT] = LLM_TOKEN_INDICATOR
    return dict(
        hidden_states=hidden_states,
        encoder_hidden_states=encoder_hidden_states,
        timestep=torch.rand(1, generator=gen),
        position_ids=position_ids,
        segment_ids=torch.ones(1, length, dtype=torch.long),
        indicator=indicator,
    )


def _hunyuan_image_inputs(gen: torch.Generator) -> dict:
    """6 x 8 latent tokens (patch 1); two text encoders' 24 tokens."""
    return dict(
        hidden_states=_image(gen, 4, 6, 8),
        timestep=_step(gen),
        encoder_hidden_states=_text(gen, 32),
        encoder_attention_mask=torch.ones(1, _TEXT),
        encoder_hidden_states_2=_text(gen, 32),
        encoder_attention_mask_2=torch.ones(1, _TEXT),
    )


def _bria_fibo2_inputs(gen: torch.Generator) -> dict:
    """6 x 8 patches of the image and of one image to edit, and 24 gist tokens: 120; the text's first bundle feeds
    the Perceiver, the second the injection block."""
    return dict(
        hidden_states=_image(gen, 4, 12, 16),
        timestep=torch.rand(1, generator=gen),
        encoder_hidden_states=torch.randn(1, 2, _TEXT, 16, generator=gen),
        context_latents=[_image(gen, 4, 12, 16)],
    )


def _cogvideox_inputs(gen: torch.Generator) -> dict:
    """2 frames of 12 x 12 latents ([B, F, C, H, W]): 72 tokens; the pipeline's rotary tables of the whole grid."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    return dict(
        hidden_states=torch.randn(1, 2, 4, 12, 12, generator=gen),
        encoder_hidden_states=_text(gen, 16),
        timestep=_step(gen),
        image_rotary_emb=get_3d_rotary_pos_embed(16, ((0, 0), (6, 6)), (6, 6), 2),
    )


def _framepack_inputs(gen: torch.Generator) -> dict:
    """A 24 x 16 latent in 2 x 2 patches: 2 frames (192 tokens), a clean frame (96), the 2x history (2 x 4 x 4
    patches, 24) and the 4x history (4 x 8 x 8, 24); 24 text and 24 image tokens."""
    return dict(
        hidden_states=_video(gen, 4, 2, 24, 16),
        timestep=_step(gen),
        encoder_hidden_states=_text(gen, 16),
        encoder_attention_mask=torch.ones(1, _TEXT),
        pooled_projections=_randn(gen, 1, 8),
        image_embeds=_text(gen, 16),
        indices_latents=torch.tensor([19, 20]),
        guidance=torch.tensor([5000.0]),
        latents_clean=_video(gen, 4, 1, 24, 16),
        indices_latents_clean=torch.tensor([0]),
        latents_history_2x=_video(gen, 4, 2, 24, 16),
        indices_latents_history_2x=torch.tensor([17, 18]),
        latents_history_4x=_video(gen, 4, 16, 24, 16),
        indices_latents_history_4x=torch.arange(1, 17),
    )


def _hunyuan_video15_inputs(gen: torch.Generator) -> dict:
    """2 frames of 6 x 6 latent tokens (72); 24 tokens each of text, ByT5 text and image (nonzero: zeros mean
    text-to-video, which drops them)."""
    return dict(
        hidden_states=_video(gen, 4, 2, 6, 6),
        timestep=_step(gen),
        encoder_hidden_states=_text(gen, 16),
        encoder_attention_mask=torch.ones(1, _TEXT),
        encoder_hidden_states_2=_text(gen, 8),
        encoder_attention_mask_2=torch.ones(1, _TEXT),
        image_embeds=_text(gen, 12),
    )


def _ltx2_inputs(gen: torch.Generator) -> dict:
    """2 frames of 6 x 6 latent tokens (72) and 24 audio frames."""
    return dict(
        hidden_states=_randn(gen, 1, 72, 4),
        audio_hidden_states=_randn(gen, 1, _TEXT, 4),
        encoder_hidden_states=_text(gen, 16),
        audio_encoder_hidden_states=_text(gen, 16),
        timestep=_step(gen),
        encoder_attention_mask=torch.ones(1, _TEXT, dtype=torch.bool),
        num_frames=2,
        height=6,
        width=6,
        audio_num_frames=_TEXT,
        fps=25.0,
    )


def _minimax_h3_inputs(gen: torch.Generator) -> dict:
    """One packed sequence: 24 text rows, 24 audio rows, then 2 frames of 6 x 6 video patches (72)."""
    text, audio, video = _TEXT, 24, 72
    length = text + audio + video
    text_indices = torch.arange(text)
    audio_indices = torch.arange(text, text + audio)
    video_indices = torch.arange(text + audio, length)
    token_tags = torch.zeros(length, dtype=torch.long)  # 0 video, 1 text, 2 audio
    token_tags[text_indices] = 1
    token_tags[audio_indices] = 2
    timestep_indices = torch.zeros(length, dtype=torch.long)
    timestep_indices[audio_indices] = 1
    position_ids = torch.zeros(length, 3)
    position_ids[:, 0] = torch.arange(length)
    position_ids[video_indices] = torch.stack(
        torch.meshgrid(torch.arange(2.0), torch.arange(6.0), torch.arange(6.0), indexing="ij"), dim=-1
    ).reshape(-1, 3)
    position_ids[video_indices, 0] += text + audio
    return dict(
        hidden_states=_randn(gen, 1, video, 16),
        audio_hidden_states=_randn(gen, 1, audio, 6),
        encoder_hidden_states=_text(gen, 8),
        timestep=torch.rand(2, generator=gen),
        timestep_indices=timestep_indices,
        token_tags=token_tags,
        position_ids=position_ids,
        video_indices=video_indices,
        audio_indices=audio_indices,
        text_indices=text_indices,
    )


def _kandinsky5_inputs(gen: torch.Generator) -> dict:
    """2 frames of 12 x 12 latents, channels last ([B, F, H, W, C]): 2 x 6 x 6 = 72 tokens."""
    return dict(
        hidden_states=torch.randn(1, 2, 12, 12, 4, generator=gen),
        encoder_hidden_states=_text(gen, 16),
        timestep=_step(gen),
        pooled_projections=_randn(gen, 1, 8),
        visual_rope_pos=[torch.arange(2), torch.arange(6), torch.arange(6)],
        text_rope_pos=torch.arange(_TEXT),
    )


def _kandinsky6_inputs(gen: torch.Generator) -> dict:
    """2 frames of 12 x 12 latents with the conditioning latent and mask ([B, F, H, W, 2C + 1]): 72 tokens; 24 audio
    frames."""
    return dict(
        hidden_states=torch.randn(1, 2, 12, 12, 9, generator=gen),
        encoder_hidden_states=_text(gen, 16),
        pooled_projections=_randn(gen, 1, 8),
        timestep=_step(gen),
        audio_hidden_states=_randn(gen, 1, 24, 4),
        encoder_attention_mask=torch.ones(1, _TEXT, dtype=torch.bool),
    )


def _joyimage_plus_inputs(gen: torch.Generator) -> dict:
    """The target's 6 x 8 patches then a reference image's 6 x 8, patchified ([B, N, C, 1, 2, 2]): 96 tokens."""
    return dict(
        hidden_states=torch.randn(1, 96, 16, 1, 2, 2, generator=gen),
        timestep=torch.rand(1, generator=gen),
        encoder_hidden_states=_text(gen, 16),
        encoder_hidden_states_mask=torch.ones(1, _TEXT),
        shape_list=[[(1, 6, 8), (1, 6, 8)]],
    )


def _stable_audio_inputs(gen: torch.Generator) -> dict:
    """47 latent frames behind the one global token: 48."""
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    return dict(
        hidden_states=_randn(gen, 1, 4, 47),
        timestep=_step(gen),
        encoder_hidden_states=_text(gen, 8),
        global_hidden_states=_randn(gen, 1, 1, 8),
        rotary_embedding=get_1d_rotary_pos_embed(4, 48, use_real=True, repeat_interleave_real=False),
    )


def _sana_wm_refiner_inputs(gen: torch.Generator) -> dict:
    """2 frames of 6 x 6 latent tokens (72) and their rotary tables, built as the refiner builds them."""
    from types import SimpleNamespace

    from diffusers.models.transformers.transformer_sana_wm_refiner import (
        SanaWMLTX2AudioVideoRotaryPosEmbed,
        SanaWMLTX2RefinerTransformer3DModel,
    )

    rope = SanaWMLTX2AudioVideoRotaryPosEmbed(
        dim=16,
        patch_size=1,
        patch_size_t=1,
        base_num_frames=20,
        base_height=2048,
        base_width=2048,
        scale_factors=(8, 32, 32),
        theta=10000.0,
        causal_offset=1,
        modality="video",
        double_precision=False,
        rope_type="interleaved",
        num_attention_heads=2,
    )
    rotary = SanaWMLTX2RefinerTransformer3DModel.build_rotary_emb_for_absolute_positions(
        SimpleNamespace(rope=rope), 1, [0, 1], 6, 6, torch.device("cpu"), 24.0
    )
    return dict(
        hidden_states=_randn(gen, 1, 72, 4),
        encoder_hidden_states=_text(gen, 16),
        timestep=torch.rand(1, 72, generator=gen) * 1000,
        video_rotary_emb=rotary,
        encoder_attention_mask=torch.ones(1, _TEXT),
    )


def _cosmos3_inputs(gen: torch.Generator) -> dict:
    """One packed sequence: a causal prefix of 24 text tokens, then 6 x 8 vision patches (48)."""
    text, vision = _TEXT, 48
    length = text + vision
    position_ids = torch.zeros(3, length, dtype=torch.long)
    position_ids[:, :text] = torch.arange(text)
    position_ids[0, text:] = text
    position_ids[1:, text:] = _grid_ids(6, 8)[:, 1:].long().T + text
    return dict(
        input_ids=torch.randint(0, 32, (text,), generator=gen),
        text_indexes=torch.arange(text),
        position_ids=position_ids,
        und_len=text,
        sequence_length=length,
        vision_tokens=[torch.randn(1, 2, 1, 6, 8, generator=gen)],
        vision_token_shapes=[(1, 6, 8)],
        vision_sequence_indexes=torch.arange(text, length),
        vision_mse_loss_indexes=torch.arange(text, length),
        vision_timesteps=torch.rand(vision, generator=gen),
        vision_noisy_frame_indexes=[torch.tensor([0])],
    )


ZOO: dict[str, DitSpec] = {
    "WanTransformer3DModel": DitSpec(_WAN, _wan_inputs),
    "WanVACETransformer3DModel": DitSpec(
        _WAN | dict(in_channels=16, out_channels=16, text_dim=32, vace_layers=[0, 1], vace_in_channels=48),
        lambda gen: _wan_inputs(gen, 16, 32) | dict(control_hidden_states=_video(gen, 48, 2, 12, 12)),
    ),
    "SkyReelsV2Transformer3DModel": DitSpec(_WAN, _wan_inputs),
    "ChronoEditTransformer3DModel": DitSpec(
        _WAN | dict(attention_head_dim=8, in_channels=16, out_channels=16, text_dim=32, rope_max_seq_len=64),
        lambda gen: _wan_inputs(gen, 16, 32),
    ),
    "AnyFlowTransformer3DModel": DitSpec(
        {k: v for k, v in _WAN.items() if k != "qk_norm"} | dict(gate_value=0.25, deltatime_type="r"),
        lambda gen: dict(
            hidden_states=torch.randn(1, 2, 4, 12, 12, generator=gen),  # [B, F, C, H, W]
            timestep=torch.full((1, 2), 500.0),
            r_timestep=torch.full((1, 2), 250.0),
            encoder_hidden_states=_text(gen, 16),
        ),
    ),
    "HeliosTransformer3DModel": DitSpec(
        {k: v for k, v in _WAN.items() if k != "rope_max_seq_len"}
        | dict(
            rope_dim=(4, 4, 4),
            has_multi_term_memory_patch=True,
            guidance_cross_attn=True,
            zero_history_timestep=True,
            is_amplify_history=False,
        ),
        _helios_inputs,
    ),
    "WanAnimateTransformer3DModel": DitSpec(
        _WAN
        | dict(
            in_channels=12,
            latent_channels=4,
            image_dim=16,
            motion_encoder_channel_sizes={"4": 16, "8": 16, "16": 16},
            motion_encoder_size=16,
            motion_style_dim=8,
            motion_dim=4,
            motion_encoder_dim=16,
            face_encoder_hidden_dim=16,
            face_encoder_num_heads=2,
            inject_face_latents_blocks=2,
        ),
        _wan_animate_inputs,
    ),
    "FluxTransformer2DModel": DitSpec(
        dict(
            patch_size=1,
            in_channels=4,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            axes_dims_rope=[4, 4, 8],
        ),
        lambda gen: _flux_inputs(gen) | dict(pooled_projections=_randn(gen, 1, 32)),
    ),
    "Flux2Transformer2DModel": DitSpec(
        dict(
            patch_size=1,
            in_channels=4,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            timestep_guidance_channels=256,
            axes_dims_rope=[4, 4, 4, 4],
        ),
        _flux2_inputs,
    ),
    "Flux3Transformer2DModel": DitSpec(
        dict(
            in_channels=4,
            cond_in_channels=4,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            timestep_channels=32,
            axes_dims_rope=(4, 4, 4, 4),
        ),
        _flux3_inputs,
    ),
    "ChromaTransformer2DModel": DitSpec(
        dict(
            patch_size=1,
            in_channels=4,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            axes_dims_rope=[4, 4, 8],
            approximator_num_channels=8,
            approximator_hidden_dim=16,
            approximator_layers=1,
        ),
        _flux_inputs,
    ),
    "BriaTransformer2DModel": DitSpec(
        dict(
            patch_size=1,
            in_channels=4,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=None,
            axes_dims_rope=[0, 4, 4],
        ),
        _flux_inputs,
    ),
    "BriaFiboTransformer2DModel": DitSpec(
        dict(
            patch_size=1,
            in_channels=48,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=64,
            text_encoder_dim=32,
            pooled_projection_dim=None,
            axes_dims_rope=[0, 4, 4],
        ),
        _bria_fibo_inputs,
    ),
    "LongCatImageTransformer2DModel": DitSpec(
        dict(
            patch_size=1,
            in_channels=4,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            axes_dims_rope=[4, 4, 8],
        ),
        lambda gen: _flux_inputs(gen) | dict(guidance=torch.tensor([3.5])),
    ),
    "OvisImageTransformer2DModel": DitSpec(
        dict(
            patch_size=1,
            in_channels=4,
            out_channels=4,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            axes_dims_rope=(4, 4, 8),
        ),
        _flux_inputs,
    ),
    "QwenImageTransformer2DModel": DitSpec(
        dict(
            patch_size=2,
            in_channels=16,
            out_channels=4,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=4,
            joint_attention_dim=16,
            guidance_embeds=False,
            axes_dims_rope=(8, 4, 4),
        ),
        _qwen_inputs,
    ),
    # the prediction spans the joint sequence, the prompt's positions too (the pipeline keeps the last 48 tokens)
    "QwenImage21Transformer2DModel": DitSpec(
        dict(
            patch_size=1,
            in_channels=4,
            out_channels=4,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            context_in_dim=16,
            axes_dims_rope=(8, 4, 4),
        ),
        _qwen21_inputs,
    ),
    "NucleusMoEImageTransformer2DModel": DitSpec(
        dict(
            patch_size=2,
            in_channels=16,
            out_channels=4,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=4,
            joint_attention_dim=16,
            axes_dims_rope=(8, 4, 4),
            moe_enabled=False,
            capacity_factors=[8.0, 8.0],
        ),
        _qwen_inputs,
    ),
    "HiDreamImageTransformer2DModel": DitSpec(
        dict(
            patch_size=2,
            in_channels=4,
            out_channels=4,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=8,
            num_attention_heads=4,
            caption_channels=[8, 4],
            text_emb_dim=8,
            num_routed_experts=2,
            num_activated_experts=2,
            axes_dims_rope=(4, 2, 2),
            max_resolution=(32, 32),
            llama_layers=(0, 1),
            force_inference_output=True,
        ),
        _hidream_inputs,
    ),
    "SD3Transformer2DModel": DitSpec(
        dict(
            sample_size=32,
            patch_size=1,
            in_channels=4,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=4,
            caption_projection_dim=32,
            joint_attention_dim=32,
            pooled_projection_dim=64,
            out_channels=4,
            pos_embed_max_size=96,
            dual_attention_layers=(0,),
            qk_norm="rms_norm",
        ),
        lambda gen: dict(
            hidden_states=_image(gen, 4, 6, 8),
            encoder_hidden_states=_text(gen, 32),
            pooled_projections=_randn(gen, 1, 64),
            timestep=_step(gen),
        ),
    ),
    "AuraFlowTransformer2DModel": DitSpec(
        dict(
            sample_size=32,
            patch_size=2,
            in_channels=4,
            num_mmdit_layers=1,
            num_single_dit_layers=1,
            attention_head_dim=8,
            num_attention_heads=4,
            caption_projection_dim=32,
            joint_attention_dim=32,
            out_channels=4,
            pos_embed_max_size=256,
        ),
        # the 8 register tokens join the text: 40 + 8 = 48
        lambda gen: dict(
            hidden_states=_image(gen, 4, 12, 16), encoder_hidden_states=_text(gen, 32, 40), timestep=_step(gen)
        ),
    ),
    "PixArtTransformer2DModel": DitSpec(
        dict(
            sample_size=8,
            num_layers=2,
            patch_size=2,
            attention_head_dim=8,
            num_attention_heads=2,
            in_channels=4,
            cross_attention_dim=16,
            out_channels=8,
            attention_bias=True,
            activation_fn="gelu-approximate",
            num_embeds_ada_norm=1000,
            norm_type="ada_norm_single",
            norm_elementwise_affine=False,
            norm_eps=1e-6,
            use_additional_conditions=False,
            caption_channels=16,
        ),
        lambda gen: dict(
            hidden_states=_image(gen, 4, 12, 16),
            timestep=_step(gen),
            encoder_hidden_states=_text(gen, 16),
            added_cond_kwargs={"aspect_ratio": None, "resolution": None},
        ),
    ),
    "DiTTransformer2DModel": DitSpec(
        dict(
            in_channels=4,
            out_channels=8,
            activation_fn="gelu-approximate",
            num_attention_heads=2,
            attention_head_dim=8,
            attention_bias=True,
            num_layers=2,
            norm_type="ada_norm_zero",
            num_embeds_ada_norm=8,
            patch_size=2,
            sample_size=24,
        ),
        # a square latent: DiT unpatchifies a square grid; 12 x 12 patches
        lambda gen: dict(
            hidden_states=_image(gen, 4, 24, 24),
            timestep=torch.randint(0, 1000, (1,), generator=gen),
            class_labels=torch.randint(0, 4, (1,), generator=gen),
        ),
    ),
    "Transformer2DModel": DitSpec(
        dict(
            num_attention_heads=2,
            attention_head_dim=8,
            in_channels=16,
            num_layers=1,
            norm_num_groups=4,
            cross_attention_dim=16,
            use_linear_projection=True,
        ),
        # continuous input, as in a UNet: one token per pixel of the 6 x 8 feature map
        lambda gen: dict(hidden_states=_image(gen, 16, 6, 8), encoder_hidden_states=_text(gen, 16)),
    ),
    "DreamLiteTransformer2DModel": DitSpec(
        dict(
            num_attention_heads=2,
            attention_head_dim=8,
            in_channels=16,
            num_layers=1,
            norm_num_groups=4,
            cross_attention_dim=16,
            use_linear_projection=True,
            qk_norm="rms_norm",
            ff_mult=2,
        ),
        lambda gen: dict(hidden_states=_image(gen, 16, 6, 8), encoder_hidden_states=_text(gen, 16)),
    ),
    "SanaTransformer2DModel": DitSpec(
        dict(
            patch_size=1,
            in_channels=4,
            out_channels=4,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=2,
            num_cross_attention_heads=2,
            cross_attention_head_dim=8,
            cross_attention_dim=16,
            caption_channels=16,
            sample_size=32,
        ),
        lambda gen: dict(hidden_states=_image(gen, 4, 6, 8), encoder_hidden_states=_text(gen, 16), timestep=_step(gen)),
    ),
    "Lumina2Transformer2DModel": DitSpec(
        dict(
            sample_size=16,
            patch_size=2,
            in_channels=4,
            hidden_size=24,
            num_layers=2,
            num_refiner_layers=1,
            num_attention_heads=3,
            num_kv_heads=1,
            multiple_of=2,
            norm_eps=1e-5,
            scaling_factor=1.0,
            axes_dim_rope=(4, 2, 2),
            axes_lens=(128, 128, 128),
            cap_feat_dim=32,
        ),
        lambda gen: dict(
            hidden_states=_image(gen, 4, 12, 16),
            timestep=torch.rand(1, generator=gen),
            encoder_hidden_states=_text(gen, 32),
            encoder_attention_mask=torch.ones(1, _TEXT, dtype=torch.bool),
        ),
    ),
    "LuminaNextDiT2DModel": DitSpec(
        dict(
            sample_size=16,
            patch_size=2,
            in_channels=4,
            hidden_size=24,
            num_layers=2,
            num_attention_heads=3,
            num_kv_heads=1,
            multiple_of=16,
            norm_eps=1e-5,
            learn_sigma=False,
            qk_norm=True,
            cross_attention_dim=32,
            scaling_factor=1.0,
        ),
        _lumina_next_inputs,
    ),
    "HunyuanDiT2DModel": DitSpec(
        dict(
            sample_size=8,
            patch_size=2,
            in_channels=4,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=2,
            cross_attention_dim=8,
            cross_attention_dim_t5=8,
            pooled_projection_dim=4,
            hidden_size=16,
            text_len=_TEXT,
            text_len_t5=_TEXT,
            activation_fn="gelu-approximate",
        ),
        _hunyuan_dit_inputs,
    ),
    "CogView3PlusTransformer2DModel": DitSpec(
        dict(
            patch_size=2,
            in_channels=4,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=2,
            out_channels=4,
            text_embed_dim=8,
            time_embed_dim=8,
            condition_dim=2,
            pos_embed_max_size=8,
            sample_size=8,
        ),
        lambda gen: (
            dict(hidden_states=_image(gen, 4, 12, 16), encoder_hidden_states=_text(gen, 8), timestep=_step(gen))
            | _sizes()
        ),
    ),
    "CogView4Transformer2DModel": DitSpec(
        dict(
            patch_size=2,
            in_channels=4,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=2,
            out_channels=4,
            text_embed_dim=8,
            time_embed_dim=8,
            condition_dim=4,
        ),
        lambda gen: (
            dict(hidden_states=_image(gen, 4, 12, 16), encoder_hidden_states=_text(gen, 8), timestep=_step(gen))
            | _sizes()
        ),
    ),
    "GlmImageTransformer2DModel": DitSpec(
        dict(
            patch_size=2,
            in_channels=4,
            out_channels=4,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=2,
            text_embed_dim=32,
            time_embed_dim=16,
            condition_dim=8,
            prior_vq_quantizer_codebook_size=64,
        ),
        lambda gen: dict(
            hidden_states=_image(gen, 4, 12, 16),
            encoder_hidden_states=_text(gen, 32),
            prior_token_id=torch.randint(0, 64, (1, 48), generator=gen),  # one per patch
            prior_token_drop=torch.zeros(1, 48, dtype=torch.bool),
            timestep=_step(gen),
            target_size=torch.tensor([[12.0, 16.0]]),
            crop_coords=torch.tensor([[0.0, 0.0]]),
        ),
    ),
    "PRXTransformer2DModel": DitSpec(
        dict(
            in_channels=16,
            patch_size=2,
            context_in_dim=16,
            hidden_size=32,
            mlp_ratio=3.5,
            num_heads=2,
            depth=2,
            axes_dim=[8, 8],
            theta=10_000,
        ),
        lambda gen: dict(
            hidden_states=_image(gen, 16, 12, 16),
            timestep=torch.rand(1, generator=gen),
            encoder_hidden_states=_text(gen, 16),
        ),
    ),
    # the prediction is a list of one tensor a sample
    "ZImageTransformer2DModel": DitSpec(
        dict(
            all_patch_size=(2,),
            all_f_patch_size=(1,),
            in_channels=16,
            dim=16,
            n_layers=2,
            n_refiner_layers=1,
            n_heads=2,
            n_kv_heads=2,
            qk_norm=True,
            cap_feat_dim=16,
            rope_theta=256.0,
            t_scale=1000.0,
            axes_dims=[4, 2, 2],
            axes_lens=[256, 32, 32],
        ),
        _z_image_inputs,
    ),
    "ErnieImageTransformer2DModel": DitSpec(
        dict(
            hidden_size=16,
            num_attention_heads=1,
            num_layers=2,
            ffn_hidden_size=16,
            in_channels=16,
            out_channels=16,
            patch_size=1,
            text_in_dim=16,
            rope_theta=256,
            rope_axes_dim=(8, 4, 4),
            eps=1e-6,
            qk_layernorm=True,
        ),
        lambda gen: dict(
            hidden_states=_image(gen, 16, 6, 8),
            timestep=torch.rand(1, generator=gen),
            text_bth=_text(gen, 16),
            text_lens=torch.tensor([_TEXT]),
        ),
    ),
    "OmniGenTransformer2DModel": DitSpec(
        dict(
            hidden_size=16,
            num_attention_heads=2,
            num_key_value_heads=2,
            intermediate_size=32,
            num_layers=2,
            pad_token_id=0,
            vocab_size=1000,
            in_channels=4,
            time_step_dim=4,
            rope_scaling={"long_factor": list(range(1, 5)), "short_factor": list(range(1, 5))},
        ),
        _omnigen_inputs,
    ),
    "Krea2Transformer2DModel": DitSpec(
        dict(
            in_channels=16,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=32,
            timestep_embed_dim=8,
            text_hidden_dim=16,
            num_text_layers=3,
            text_num_attention_heads=2,
            text_num_key_value_heads=1,
            text_intermediate_size=16,
            num_layerwise_text_blocks=1,
            num_refiner_text_blocks=1,
            axes_dims_rope=(4, 2, 2),
            rope_theta=1000.0,
            norm_eps=1e-5,
        ),
        _krea2_inputs,
    ),
    "Ideogram4Transformer2DModel": DitSpec(
        dict(
            in_channels=16,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=4,
            intermediate_size=32,
            adaln_dim=16,
            llm_features_dim=24,
            rope_theta=10_000,
            mrope_section=(2, 1, 1),
            norm_eps=1e-5,
        ),
        _ideogram4_inputs,
    ),
    # the ByT5 projection is 2048 wide whatever the config: 4.3M of its parameters
    "HunyuanImageTransformer2DModel": DitSpec(
        dict(
            in_channels=4,
            out_channels=4,
            num_attention_heads=4,
            attention_head_dim=8,
            num_layers=1,
            num_single_layers=1,
            num_refiner_layers=1,
            patch_size=(1, 1),
            guidance_embeds=False,
            text_embed_dim=32,
            text_embed_2_dim=32,
            rope_axes_dim=(4, 4),
        ),
        _hunyuan_image_inputs,
    ),
    "BriaFibo2Transformer2DModel": DitSpec(
        dict(
            in_channels=4,
            patch_size=2,
            dim=32,
            n_layers=2,
            n_refiner_layers=1,
            n_heads=2,
            cap_feat_dim=16,
            injection_layer_ids=(1,),
            perceiver_num_layers=1,
            min_num_gist_tokens=24,
            max_num_gist_tokens=24,
            gist_step=24,
            gist_min_text_len=8,
            gist_max_text_len=64,
            axes_dims=(4, 6, 6),
            axes_lens=(64, 32, 32),
        ),
        _bria_fibo2_inputs,
    ),
    "AllegroTransformer3DModel": DitSpec(
        dict(
            num_attention_heads=2,
            attention_head_dim=8,
            in_channels=4,
            out_channels=4,
            num_layers=2,
            cross_attention_dim=16,
            sample_width=12,
            sample_height=12,
            sample_frames=8,
            caption_channels=8,
        ),
        lambda gen: dict(
            hidden_states=_video(gen, 4, 2, 12, 12), encoder_hidden_states=_text(gen, 8), timestep=_step(gen)
        ),
    ),
    "LatteTransformer3DModel": DitSpec(
        dict(
            sample_size=8,
            num_layers=1,
            patch_size=2,
            attention_head_dim=8,
            num_attention_heads=2,
            caption_channels=8,
            in_channels=4,
            cross_attention_dim=16,
            out_channels=8,
            attention_bias=True,
            activation_fn="gelu-approximate",
            num_embeds_ada_norm=1000,
            norm_type="ada_norm_single",
            norm_elementwise_affine=False,
            norm_eps=1e-6,
            video_length=2,
        ),
        # spatial attention runs within a frame: 6 x 8 patches (48) a frame
        lambda gen: dict(
            hidden_states=_video(gen, 4, 2, 12, 16),
            encoder_hidden_states=_text(gen, 8),
            timestep=_step(gen),
            enable_temporal_attentions=True,
        ),
    ),
    "CogVideoXTransformer3DModel": DitSpec(
        dict(
            num_attention_heads=2,
            attention_head_dim=16,
            in_channels=4,
            out_channels=4,
            time_embed_dim=16,
            text_embed_dim=16,
            num_layers=2,
            sample_width=12,
            sample_height=12,
            sample_frames=5,
            patch_size=2,
            max_text_seq_length=_TEXT,
            use_rotary_positional_embeddings=True,
        ),
        _cogvideox_inputs,
    ),
    "ConsisIDTransformer3DModel": DitSpec(
        dict(
            num_attention_heads=2,
            attention_head_dim=8,
            in_channels=4,
            out_channels=4,
            time_embed_dim=2,
            text_embed_dim=8,
            num_layers=2,
            sample_width=12,
            sample_height=12,
            sample_frames=5,
            patch_size=2,
            max_text_seq_length=_TEXT,
            cross_attn_interval=1,
            is_kps=False,
            is_train_face=True,
            cross_attn_dim_head=8,
            cross_attn_num_heads=2,
            LFE_id_dim=2,
            LFE_vit_dim=2,
            LFE_depth=1,
            LFE_dim_head=8,
            LFE_num_heads=2,
            LFE_num_id_token=1,
            LFE_num_querie=1,
            LFE_output_dim=10,  # the face cross-attention's key width: 2 / 3 of the 16 channels
            LFE_ff_mult=1,
            LFE_num_scale=1,
        ),
        lambda gen: dict(
            hidden_states=torch.randn(1, 2, 4, 12, 12, generator=gen),  # [B, F, C, H, W]
            encoder_hidden_states=_text(gen, 8),
            timestep=_step(gen),
            id_vit_hidden=[_randn(gen, 1, 2, 2)],
            id_cond=_randn(gen, 1, 2),
        ),
    ),
    "EasyAnimateTransformer3DModel": DitSpec(
        dict(
            attention_head_dim=16,
            num_attention_heads=2,
            in_channels=4,
            mmdit_layers=2,
            num_layers=2,
            out_channels=4,
            patch_size=2,
            sample_height=60,
            sample_width=90,
            text_embed_dim=16,
            time_embed_dim=8,
            time_position_encoding_type="3d_rope",
            timestep_activation_fn="silu",
        ),
        lambda gen: dict(
            hidden_states=_video(gen, 4, 2, 12, 12), timestep=_step(gen), encoder_hidden_states=_text(gen, 16)
        ),
    ),
    "MochiTransformer3DModel": DitSpec(
        dict(
            patch_size=2,
            num_attention_heads=2,
            attention_head_dim=8,
            num_layers=2,
            pooled_projection_dim=16,
            in_channels=4,
            out_channels=None,
            qk_norm="rms_norm",
            text_embed_dim=16,
            time_embed_dim=4,
            activation_fn="swiglu",
            max_sequence_length=_TEXT,
        ),
        lambda gen: dict(
            hidden_states=_video(gen, 4, 2, 12, 12),
            encoder_hidden_states=_text(gen, 16),
            timestep=_step(gen),
            encoder_attention_mask=torch.ones(1, _TEXT, dtype=torch.bool),
        ),
    ),
    "LTXVideoTransformer3DModel": DitSpec(
        dict(
            in_channels=4,
            out_channels=4,
            num_attention_heads=2,
            attention_head_dim=8,
            cross_attention_dim=16,
            num_layers=2,
            qk_norm="rms_norm_across_heads",
            caption_channels=16,
        ),
        # the latent comes patchified: [B, F * H * W, C], 2 x 6 x 6 = 72 tokens
        lambda gen: dict(
            hidden_states=_randn(gen, 1, 72, 4),
            encoder_hidden_states=_text(gen, 16),
            timestep=_step(gen),
            encoder_attention_mask=torch.ones(1, _TEXT, dtype=torch.bool),
            num_frames=2,
            height=6,
            width=6,
        ),
    ),
    "LTX2VideoTransformer3DModel": DitSpec(
        dict(
            in_channels=4,
            out_channels=4,
            patch_size=1,
            patch_size_t=1,
            num_attention_heads=2,
            attention_head_dim=8,
            cross_attention_dim=16,
            audio_in_channels=4,
            audio_out_channels=4,
            audio_num_attention_heads=2,
            audio_attention_head_dim=8,
            audio_cross_attention_dim=16,
            num_layers=2,
            qk_norm="rms_norm_across_heads",
            caption_channels=16,
            rope_double_precision=False,
        ),
        _ltx2_inputs,
    ),
    "HunyuanVideoTransformer3DModel": DitSpec(
        dict(
            in_channels=4,
            out_channels=4,
            num_attention_heads=2,
            attention_head_dim=16,
            num_layers=1,
            num_single_layers=1,
            num_refiner_layers=1,
            patch_size=2,
            patch_size_t=1,
            guidance_embeds=True,
            text_embed_dim=16,
            pooled_projection_dim=8,
            rope_axes_dim=(4, 6, 6),
        ),
        lambda gen: dict(
            hidden_states=_video(gen, 4, 2, 12, 12),
            timestep=_step(gen),
            encoder_hidden_states=_text(gen, 16),
            encoder_attention_mask=torch.ones(1, _TEXT),
            pooled_projections=_randn(gen, 1, 8),
            guidance=torch.tensor([5000.0]),
        ),
    ),
    # the ByT5 projection is 2048 wide whatever the config: 4.2M of its parameters
    "HunyuanVideo15Transformer3DModel": DitSpec(
        dict(
            in_channels=4,
            out_channels=4,
            num_attention_heads=2,
            attention_head_dim=8,
            num_layers=2,
            num_refiner_layers=1,
            mlp_ratio=2.0,
            patch_size=1,
            patch_size_t=1,
            text_embed_dim=16,
            text_embed_2_dim=8,
            image_embed_dim=12,
            rope_axes_dim=(2, 2, 4),
            target_size=16,
            task_type="t2v",
        ),
        _hunyuan_video15_inputs,
    ),
    "HunyuanVideoFramepackTransformer3DModel": DitSpec(
        dict(
            in_channels=4,
            out_channels=4,
            num_attention_heads=2,
            attention_head_dim=16,
            num_layers=1,
            num_single_layers=1,
            num_refiner_layers=1,
            patch_size=2,
            patch_size_t=1,
            guidance_embeds=True,
            text_embed_dim=16,
            pooled_projection_dim=8,
            rope_axes_dim=(4, 6, 6),
            has_image_proj=True,
            image_proj_dim=16,
            has_clean_x_embedder=True,
        ),
        _framepack_inputs,
    ),
    "CosmosTransformer3DModel": DitSpec(
        dict(
            in_channels=4,
            out_channels=4,
            num_attention_heads=2,
            attention_head_dim=12,
            num_layers=2,
            mlp_ratio=2,
            text_embed_dim=16,
            adaln_lora_dim=4,
            max_size=(4, 32, 32),
            patch_size=(1, 2, 2),
            rope_scale=(2.0, 1.0, 1.0),
            concat_padding_mask=False,  # resizing the padding mask needs torchvision
            extra_pos_embed_type="learnable",
        ),
        lambda gen: dict(
            hidden_states=_video(gen, 4, 2, 12, 12),
            timestep=_step(gen),
            encoder_hidden_states=_text(gen, 16),
            attention_mask=torch.ones(1, _TEXT),
            fps=30,
        ),
    ),
    # without return_dict the prediction comes back bare, not in a tuple: [0] is the batch's one sample
    "Kandinsky5Transformer3DModel": DitSpec(
        dict(
            in_visual_dim=4,
            in_text_dim=16,
            in_text_dim2=8,
            time_dim=16,
            out_visual_dim=4,
            patch_size=(1, 2, 2),
            model_dim=32,
            ff_dim=64,
            num_text_blocks=1,
            num_visual_blocks=2,
            axes_dims=(2, 2, 4),
            visual_cond=False,
            attention_type="regular",
        ),
        _kandinsky5_inputs,
    ),
    "Kandinsky6Transformer3DModel": DitSpec(
        dict(
            in_visual_dim=4,
            out_visual_dim=4,
            in_text_dim=16,
            in_text_dim2=8,
            time_dim=16,
            patch_size=(1, 2, 2),
            model_dim=32,
            ff_dim=64,
            num_text_blocks=1,
            num_visual_blocks=2,
            axes_dims=(2, 2, 4),
            visual_cond=True,
            in_audio_dim=4,
            out_audio_dim=4,
        ),
        _kandinsky6_inputs,
    ),
    "MotifVideoTransformer3DModel": DitSpec(
        dict(
            in_channels=33,
            out_channels=16,
            num_attention_heads=2,
            attention_head_dim=12,
            num_layers=1,
            num_single_layers=1,
            num_decoder_layers=0,
            mlp_ratio=4.0,
            patch_size=1,
            patch_size_t=1,
            qk_norm="rms_norm",
            norm_type="layer_norm",
            text_embed_dim=32,
            image_embed_dim=4,
            rope_theta=256.0,
            rope_axes_dim=(4, 4, 4),
        ),
        lambda gen: dict(
            hidden_states=_video(gen, 33, 2, 6, 6),
            encoder_hidden_states=_text(gen, 32),
            timestep=_step(gen),
            image_embeds=_text(gen, 4),
        ),
    ),
    "MiniMaxH3Transformer3DModel": DitSpec(
        dict(
            num_attention_heads=2,
            attention_head_dim=16,
            hidden_size=24,
            num_layers=2,
            num_refiner_layers=1,
            ffn_dim=32,
            in_channels=4,
            audio_in_channels=6,
            patch_size=(1, 2, 2),
            text_dim=8,
            freq_dim=8,
            time_embed_hidden_dim=24,
            time_embed_dim=16,
            rope_freq_dim=2,
        ),
        _minimax_h3_inputs,
    ),
    "JoyImageEditTransformer3DModel": DitSpec(
        dict(
            patch_size=[1, 2, 2],
            in_channels=16,
            hidden_size=32,
            num_attention_heads=2,
            text_dim=16,
            num_layers=2,
            rope_dim_list=[4, 6, 6],
            theta=256,
        ),
        lambda gen: dict(
            hidden_states=_video(gen, 16, 1, 12, 16),
            timestep=torch.rand(1, generator=gen),
            encoder_hidden_states=_text(gen, 16),
        ),
    ),
    "JoyImageEditPlusTransformer3DModel": DitSpec(
        dict(
            patch_size=[1, 2, 2],
            in_channels=16,
            hidden_size=32,
            num_attention_heads=2,
            text_dim=16,
            num_layers=2,
            rope_dim_list=[4, 6, 6],
            theta=256,
        ),
        _joyimage_plus_inputs,
    ),
    "SanaVideoTransformer3DModel": DitSpec(
        dict(
            in_channels=16,
            out_channels=16,
            num_attention_heads=2,
            attention_head_dim=12,
            num_layers=2,
            num_cross_attention_heads=2,
            cross_attention_head_dim=12,
            cross_attention_dim=24,
            caption_channels=16,
            mlp_ratio=2.5,
            dropout=0.0,
            attention_bias=False,
            sample_size=8,
            patch_size=(1, 2, 2),
            norm_elementwise_affine=False,
            norm_eps=1e-6,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
        ),
        lambda gen: dict(
            hidden_states=_video(gen, 16, 2, 12, 12), encoder_hidden_states=_text(gen, 16), timestep=_step(gen)
        ),
    ),
    "TransformerTemporalModel": DitSpec(
        dict(num_attention_heads=2, attention_head_dim=8, in_channels=16, num_layers=1, norm_num_groups=1),
        # attention runs over the frames of each pixel: 24 frames ([B * F, C, H, W]) of 2 x 2
        lambda gen: dict(hidden_states=_image(gen, 16, 2, 2, batch=24), timestep=_step(gen), num_frames=24),
    ),
    "SanaWMTransformer3DModel": DitSpec(
        dict(
            in_channels=4,
            num_layers=2,
            hidden_size=32,
            num_attention_heads=2,
            patch_size=(1, 1, 1),
            softmax_every_n=2,
            linear_head_dim=16,
            chunk_plucker_channels=6,
            chunk_plucker_post_attn_blocks=2,
            image_size=64,
            caption_channels=16,
            mlp_ratio=2.0,
            mixed_precision="fp32",
        ),
        lambda gen: dict(
            hidden_states=_video(gen, 4, 2, 6, 6),
            timestep=torch.full((1, 1, 2), 500.0),  # one per frame
            encoder_hidden_states=_text(gen, 16)[:, None],
            encoder_attention_mask=torch.ones(1, _TEXT),
        ),
    ),
    "SanaWMLTX2RefinerTransformer3DModel": DitSpec(
        dict(
            in_channels=4,
            out_channels=4,
            num_attention_heads=2,
            attention_head_dim=8,
            cross_attention_dim=16,
            audio_in_channels=4,
            audio_out_channels=4,
            audio_num_attention_heads=2,
            audio_attention_head_dim=8,
            audio_cross_attention_dim=16,
            num_layers=2,
            caption_channels=16,
            rope_double_precision=False,
        ),
        _sana_wm_refiner_inputs,
    ),
    # the prediction is a list of one tensor a vision item
    "Cosmos3OmniTransformer": DitSpec(
        dict(
            dtype="float32",
            head_dim=8,
            hidden_act="relu2",
            hidden_size=16,
            intermediate_size=32,
            latent_channel=2,
            latent_patch_size=1,
            num_attention_heads=2,
            num_hidden_layers=2,
            num_key_value_heads=1,
            patch_latent_dim=2,
            qk_norm_for_text=False,
            rms_norm_eps=1e-5,
            rope_axes_dim=[2, 1, 1],
            rope_theta=1e8,
            vocab_size=32,
        ),
        _cosmos3_inputs,
    ),
    "AceStepTransformer1DModel": DitSpec(
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            in_channels=24,
            audio_acoustic_hidden_dim=8,
            patch_size=2,
            rope_theta=10000.0,
            attention_dropout=0.0,
            rms_norm_eps=1e-6,
            sliding_window=16,
        ),
        # 96 latent frames in patches of 2: 48 tokens, a sliding-window layer and a full one
        lambda gen: dict(
            hidden_states=_randn(gen, 1, 96, 8),
            timestep=torch.rand(1, generator=gen),
            timestep_r=torch.rand(1, generator=gen),
            encoder_hidden_states=_text(gen, 32),
            context_latents=_randn(gen, 1, 96, 16),
        ),
    ),
    "StableAudioDiTModel": DitSpec(
        dict(
            sample_size=4,
            in_channels=4,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=2,
            num_key_value_attention_heads=1,
            out_channels=4,
            cross_attention_dim=8,
            time_proj_dim=8,
            global_states_input_dim=8,
            cross_attention_input_dim=8,
        ),
        _stable_audio_inputs,
    ),
    "StableAudio3DiTModel": DitSpec(
        dict(
            io_channels=8,
            patch_size=1,
            embed_dim=32,
            depth=2,
            num_heads=4,
            cond_token_dim=16,
            global_cond_dim=12,
            local_add_cond_dim=5,
            timestep_features_dim=16,
            ff_mult=2,
            num_memory_tokens=24,
            use_differential_attention=True,
        ),
        # 24 memory tokens prepended to 48 latent frames
        lambda gen: dict(
            hidden_states=_randn(gen, 1, 8, 48),
            timestep=torch.rand(1, generator=gen),
            encoder_hidden_states=_text(gen, 16),
            global_hidden_states=_randn(gen, 1, 12),
            local_add_cond=_randn(gen, 1, 5, 48),
        ),
    ),
    "LongCatAudioDiTTransformer": DitSpec(
        dict(dit_dim=64, dit_depth=2, dit_heads=4, dit_text_dim=32, latent_dim=8, dropout=0.0, text_conv=False),
        lambda gen: dict(
            hidden_states=_randn(gen, 1, 48, 8),
            encoder_hidden_states=_text(gen, 32),
            encoder_attention_mask=torch.ones(1, _TEXT, dtype=torch.bool),
            timestep=torch.rand(1, generator=gen),
            attention_mask=torch.ones(1, 48, dtype=torch.bool),
            latent_cond=_randn(gen, 1, 48, 8),
        ),
    ),
    "MiniMaxMusic3Transformer1DModel": DitSpec(
        dict(
            in_channels=8,
            condition_dim=16,
            num_layers=2,
            num_attention_heads=2,
            attention_head_dim=8,
            ff_inner_dim=32,
            rotary_dim=4,
            fourier_embedding_dim=8,
        ),
        # the timestep token is prepended to the 47 latent frames (48), the condition frame-aligned with them
        lambda gen: dict(
            hidden_states=_randn(gen, 1, 8, 47),
            timestep=torch.rand(1, generator=gen),
            encoder_hidden_states=_text(gen, 16, 47),
        ),
    ),
}

SET_ASIDE: dict[str, str] = {
    "PriorTransformer": "the unCLIP prior: it denoises one CLIP image embedding (a vector), attending over the "
    "prompt's 77 tokens and 4 added embeddings under a causal mask; no latent token sequence",
    "T5FilmDecoder": "the spectrogram-diffusion T5 decoder: a fixed 256-frame target under a note encoder's "
    "encodings; its forward takes no return_dict",
    "DualTransformer2DModel": "a wrapper mixing two Transformer2DModel (swept here) over a condition it cuts at the "
    "fixed lengths 77 and 257",
    "MiniMaxMusic3RVQDepthDecoder": "an autoregressive (causal) decoder over one audio frame's RVQ codebooks, at most "
    "16 positions: no denoiser; its forward takes inputs_embeds only, no timestep or return_dict",
    "RFD4ProteinaTransformer": "a protein-structure flow model: its residue tokens attend with a bias from an N x N "
    "pair representation that triangle updates rewrite, and it reads the molecular preprocessor's features",
    "AnyFlowFARTransformer3DModel": "its causal frame-chunk self-attention (AnyFlowCausalAttnProcessor) runs through a "
    "flex BlockMask on the flex backend only, never native attention",
    "Kandinsky6SRTransformer3DModel": "its NABLA sparse self-attention runs through a flex BlockMask on the flex "
    "backend only, never native attention",
    "WanAnimate2Transformer3DModel": "its denoising pass (kv_cache_mode='cached') attends through a flex BlockMask on "
    "the flex backend only, against a KV cache a separate reference pass fills; the reference pass ignores the "
    "timestep",
}


_UNINITIALISED = {"LuminaNextDiT2DModel": ("pad_token",)}
"""Parameters a class leaves as ``torch.empty``: zeroed before the draw, or two builds would differ."""


def build(name: str) -> tuple[torch.nn.Module, dict]:
    """The class's model (float32, in train mode, every parameter moved off its initial value by a fixed draw) and its
    inputs; two calls give the same weights and the same inputs."""
    import diffusers.models.transformers as transformers
    from diffusers.models.embeddings import LabelEmbedding

    spec = ZOO[name]
    torch.manual_seed(0)
    model = getattr(transformers, name)(**spec.config).float()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for attribute in _UNINITIALISED.get(name, ()):
            getattr(model, attribute).zero_()
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(module, LabelEmbedding):  # DiT drops class labels at random in training (for guidance)
            module.dropout_prob = 0.0
    return model, spec.inputs(torch.Generator().manual_seed(2))
