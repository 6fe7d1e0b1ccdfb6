"""Tiny diffusers transformers from configs and a batch for each, shared by the DiT tests and nothing else.

Every builder seeds the weights the same way on every rank and moves them off the zero initialisations (which
would hide a wrong gradient); every batch is drawn from a fixed seed, so all ranks hold the same one.
"""

from __future__ import annotations

import torch

FRAMES, HEIGHT, WIDTH, TEXT = 2, 12, 12, 8  # 2 x 6 x 6 = 72 tokens after patchify: divides 2P chunks for P = 2, 3, 4
JOINT_TEXT = 24  # text tokens in a joint attention: divide 2P chunks for P = 2, 3, 4
TEXT_PADDING = 7  # of them, padding (HunyuanVideo, Qwen-Image): the last shard's text is padding at P = 4
TOKENS = FRAMES * (HEIGHT // 2) * (WIDTH // 2)

CONFIGS = {
    "wan": dict(
        patch_size=(1, 2, 2),
        num_attention_heads=4,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=16,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        rope_max_seq_len=32,
    ),
    "ltx": dict(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=16,
        cross_attention_dim=32,
        num_layers=2,
        caption_channels=16,
    ),
    "cogvideox": dict(
        num_attention_heads=4,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        time_embed_dim=16,
        text_embed_dim=16,
        num_layers=2,
        sample_width=WIDTH,
        sample_height=HEIGHT,
        sample_frames=5,
        patch_size=2,
        max_text_seq_length=JOINT_TEXT,
        use_rotary_positional_embeddings=True,
    ),
    "hunyuan_video": dict(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=1,
        num_single_layers=1,
        num_refiner_layers=1,
        patch_size=2,
        text_embed_dim=16,
        pooled_projection_dim=8,
        rope_axes_dim=(4, 6, 6),
    ),
    "flux": dict(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=16,
        pooled_projection_dim=8,
        guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),
    ),
    "qwen_image": dict(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=16,
        axes_dims_rope=(4, 6, 6),
    ),
}
CLASSES = {
    "wan": "WanTransformer3DModel",
    "ltx": "LTXVideoTransformer3DModel",
    "cogvideox": "CogVideoXTransformer3DModel",
    "hunyuan_video": "HunyuanVideoTransformer3DModel",
    "flux": "FluxTransformer2DModel",
    "qwen_image": "QwenImageTransformer2DModel",
}
PER_TOKEN_TIMESTEPS = ("wan", "ltx")  # the families whose timestep may be one per token ([B, S])


def dit_model(family: str, **config: object) -> torch.nn.Module:
    """The family's tiny transformer (``config`` overriding its settings), seed 0, every weight moved by N(0, 0.02)."""
    import diffusers

    torch.manual_seed(0)
    model = getattr(diffusers, CLASSES[family])(**(CONFIGS[family] | config))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def _timestep(per_token: bool, gen: torch.Generator, tokens: int = TOKENS) -> torch.Tensor:
    return torch.randint(0, 1000, (1, tokens) if per_token else (1,), generator=gen).float()


def dit_batch(family: str, per_token: bool = False, seed: int = 1, height: int = HEIGHT) -> tuple[dict, torch.Tensor]:
    """The keyword arguments of one call of the family's model, and a regression target of its output's shape."""
    gen = torch.Generator().manual_seed(seed)
    if family == "wan":
        latents = torch.randn(1, 4, FRAMES, height, height, generator=gen)
        tokens = FRAMES * (height // 2) ** 2
        text = torch.randn(1, TEXT, 16, generator=gen)
        inputs = dict(hidden_states=latents, timestep=_timestep(per_token, gen, tokens), encoder_hidden_states=text)
        return inputs, torch.randn(latents.shape, generator=gen)
    if family == "ltx":  # the latent comes patchified: [B, F * H * W, C]
        mask = torch.ones(1, TEXT)
        mask[:, -3:] = 0  # padded prompt tokens, masked in the (local) cross-attention
        inputs = dict(
            hidden_states=torch.randn(1, TOKENS, 4, generator=gen),
            encoder_hidden_states=torch.randn(1, TEXT, 16, generator=gen),
            timestep=_timestep(per_token, gen),
            encoder_attention_mask=mask,
            num_frames=FRAMES,
            height=HEIGHT // 2,
            width=WIDTH // 2,
        )
        return inputs, torch.randn(1, TOKENS, 4, generator=gen)
    if family == "cogvideox":
        from diffusers.models.embeddings import get_3d_rotary_pos_embed

        latents = torch.randn(1, FRAMES, 4, HEIGHT, WIDTH, generator=gen)  # [B, F, C, H, W]
        grid = (HEIGHT // 2, WIDTH // 2)
        rope = get_3d_rotary_pos_embed(16, ((0, 0), grid), grid, FRAMES)  # the pipeline's tables of the whole grid
        text = torch.randn(1, JOINT_TEXT, 16, generator=gen)
        inputs = dict(hidden_states=latents, encoder_hidden_states=text, timestep=torch.tensor([421]))
        return inputs | dict(image_rotary_emb=rope), torch.randn(latents.shape, generator=gen)
    text = torch.randn(1, JOINT_TEXT, 16, generator=gen)
    padding = torch.ones(1, JOINT_TEXT, dtype=torch.long)
    padding[:, -TEXT_PADDING:] = 0  # a prompt shorter than the text length: its padding hidden from every query
    if family == "hunyuan_video":
        latents = torch.randn(1, 4, FRAMES, height, height if height != HEIGHT else WIDTH, generator=gen)
        inputs = dict(
            hidden_states=latents,
            timestep=torch.tensor([421]),
            encoder_hidden_states=text,
            encoder_attention_mask=padding,
            pooled_projections=torch.randn(1, 8, generator=gen),
            guidance=torch.tensor([5000.0]),
        )
        return inputs, torch.randn(latents.shape, generator=gen)
    if family == "flux":  # 6 x 12 packed latent patches
        grid = torch.meshgrid(torch.zeros(1), torch.arange(6.0), torch.arange(12.0), indexing="ij")
        inputs = dict(
            hidden_states=torch.randn(1, TOKENS, 4, generator=gen),
            encoder_hidden_states=text,
            pooled_projections=torch.randn(1, 8, generator=gen),
            timestep=torch.tensor([0.37]),
            img_ids=torch.stack(grid, dim=-1).reshape(-1, 3),
            txt_ids=torch.zeros(JOINT_TEXT, 3),
        )
        return inputs, torch.randn(1, TOKENS, 4, generator=gen)
    # qwen_image: 6 x 12 packed 2 x 2 patches of 4 channels
    inputs = dict(
        hidden_states=torch.randn(1, TOKENS, 16, generator=gen),
        encoder_hidden_states=text,
        timestep=torch.tensor([0.37]),
        img_shapes=[[(1, 6, 12)]],
        encoder_hidden_states_mask=padding,
    )
    return inputs, torch.randn(1, TOKENS, 16, generator=gen)
