"""Tiny Hugging Face causal language models and token batches shared by the model-level tests.

Kept apart from ``tests._cases`` so that the attention tests do not import transformers.
"""

from __future__ import annotations

import torch
import transformers

__all__ = ["SEQ", "VOCAB", "build", "documents_alone_history", "tiny_config", "tokens"]

SEQ = 48  # divides 2P for P = 1..4
VOCAB = 96


def tiny_config(kind: str):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    if kind == "qwen2":
        return transformers.Qwen2Config(**common)
    if kind == "mistral":
        return transformers.MistralConfig(**common, sliding_window=7)
    if kind == "qwen3":  # q/k norms
        return transformers.Qwen3Config(**common, head_dim=12)
    if kind == "gemma3":  # sliding and full layers alternate, query_pre_attn_scalar scaling, logit soft-cap
        layers = ["sliding_attention", "full_attention"]
        return transformers.Gemma3TextConfig(**common, head_dim=12, sliding_window=5, layer_types=layers)
    if kind == "gemma2":  # 4 layers, sliding and full alternating, attention logits soft-capped at 1
        four = {**common, "num_hidden_layers": 4, "initializer_range": 0.2}  # scores of a few units: the cap bends
        return transformers.Gemma2Config(
            **four, head_dim=12, sliding_window=5, query_pre_attn_scalar=12, attn_logit_softcapping=1.0
        )
    if kind == "gpt_oss":  # 4 layers, sliding and full alternating, a learned sink per head, 4 experts
        four = {**common, "num_hidden_layers": 4, "initializer_range": 0.2}
        yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32, "rope_theta": 1e4}
        return transformers.GptOssConfig(
            **four, head_dim=12, sliding_window=5, num_local_experts=4, num_experts_per_tok=2, rope_parameters=yarn
        )
    if kind in ("mixtral", "qwen3_moe"):  # 4 layers, 4 experts, top-2, router logits out (loss weight 0.1)
        four = {**common, "num_hidden_layers": 4, "initializer_range": 0.2}
        moe = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1)
        if kind == "mixtral":
            return transformers.MixtralConfig(**four, num_local_experts=4, **moe)
        return transformers.Qwen3MoeConfig(**four, head_dim=12, num_experts=4, moe_intermediate_size=32, **moe)
    if kind == "phi3":  # fused qkv projection
        return transformers.Phi3Config(**common, pad_token_id=0)
    if kind == "olmo2":
        return transformers.Olmo2Config(**common)
    if kind in ("deepseek_v2", "deepseek_v3", "minicpm3"):  # MLA: q/k heads of 16 (8 rotary), values of 12
        mla = dict(kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12)
        mha = {**common, "num_key_value_heads": 4, "initializer_range": 0.2}
        if kind == "minicpm3":
            return transformers.MiniCPM3Config(**mha, **mla)
        moe = dict(n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, moe_intermediate_size=32)
        cls = transformers.DeepseekV2Config if kind == "deepseek_v2" else transformers.DeepseekV3Config
        return cls(**mha, **mla, **moe, n_shared_experts=1, n_group=1, topk_group=1)
    if kind == "lfm2":  # a hybrid: short convolutions in layers 0, 2, 3, attention in layer 1
        return transformers.Lfm2Config(
            **{**common, "num_hidden_layers": 4, "initializer_range": 0.2},  # taps large enough that a halo matters
            layer_types=["conv", "full_attention", "conv", "conv"],
            conv_L_cache=3,
            conv_bias=True,
        )
    if kind == "qwen3_next":  # a hybrid: gated DeltaNet in layers 0, 2, 3, gated attention in layer 1, experts
        return transformers.Qwen3NextConfig(
            **{**common, "num_hidden_layers": 4},
            head_dim=12,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        )
    if kind in ("qwen3_5", "qwen3_5_moe"):  # Qwen3.5's text model: gated DeltaNet with separate projections
        linear = dict(
            head_dim=12,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
        )
        if kind == "qwen3_5":  # dense MLPs
            return transformers.Qwen3_5TextConfig(**{**common, "num_hidden_layers": 4}, **linear)
        experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
        return transformers.Qwen3_5MoeTextConfig(
            **{**common, "num_hidden_layers": 4}, **linear, **experts, shared_expert_intermediate_size=32
        )
    if kind == "granitemoehybrid":  # a hybrid: Mamba2 (SSD) in layers 0, 2, 3, attention in layer 1, no rotary
        return transformers.GraniteMoeHybridConfig(
            **{**common, "num_hidden_layers": 4},
            layer_types=["mamba", "attention", "mamba", "mamba"],
            mamba_n_heads=4,
            mamba_d_head=24,
            mamba_d_state=8,
            mamba_n_groups=1,
            mamba_chunk_size=16,
            shared_intermediate_size=64,
            num_local_experts=0,
        )
    if kind == "bamba":  # GraniteMoeHybrid's Mamba2 layer in another model: layers 0, 2, 3; attention in 1
        return transformers.BambaConfig(
            **{**common, "num_hidden_layers": 4},
            attn_layer_indices=[1],
            mamba_n_heads=4,
            mamba_d_head=24,
            mamba_d_state=8,
            mamba_n_groups=1,
            mamba_chunk_size=16,
        )
    if kind == "olmo_hybrid":  # gated DeltaNet (separate projections, beta up to 2) in layers 0, 2, 3; attention in 1
        return transformers.OlmoHybridConfig(
            **{**common, "num_hidden_layers": 4},
            pad_token_id=0,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
        )
    if kind == "falcon_h1":  # attention and Mamba2 side by side in every layer, muP multipliers
        return transformers.FalconH1Config(
            **{**common, "num_hidden_layers": 4, "initializer_range": 0.2},  # the Mamba2 half large enough to matter
            head_dim=12,
            mamba_n_heads=4,
            mamba_d_head=24,
            mamba_d_ssm=96,
            mamba_d_state=8,
            mamba_n_groups=1,
            mamba_chunk_size=16,
        )
    if kind == "nemotron_h":  # Mamba2, experts, attention (no rotary) and an MLP, each a layer of its own at "mixer"
        return transformers.NemotronHConfig(
            **{**common, "num_hidden_layers": 4, "initializer_range": 0.2},
            layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
            head_dim=12,
            mamba_num_heads=4,
            mamba_head_dim=24,
            ssm_state_size=8,
            n_groups=1,
            chunk_size=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=32,
        )
    if kind == "mamba2":  # Mamba2 (SSD) in every layer, no attention at all
        return transformers.Mamba2Config(
            vocab_size=VOCAB,
            hidden_size=48,
            num_hidden_layers=2,
            num_heads=4,
            head_dim=24,
            state_size=8,
            n_groups=1,
            chunk_size=16,
            initializer_range=0.2,
            tie_word_embeddings=False,
        )
    if kind == "zamba2":  # Mamba2 in every layer; layers 0 and 2 first run one shared attention block (tied weights)
        return transformers.Zamba2Config(
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=3,
            layers_block_type=["hybrid", "linear_attention", "hybrid"],
            num_attention_heads=4,
            n_mamba_heads=4,
            mamba_d_state=8,
            mamba_ngroups=1,
            chunk_size=16,
            num_mem_blocks=1,
            use_shared_attention_adapter=True,
            adapter_rank=8,
            use_mem_rope=True,
            max_position_embeddings=64,
            initializer_range=0.1,
            tie_word_embeddings=False,
        )
    if kind in ("mamba", "falcon_mamba"):  # Mamba1 in every layer, no attention (Falcon-Mamba: norms on dt, B, C)
        config = transformers.MambaConfig if kind == "mamba" else transformers.FalconMambaConfig
        return config(
            vocab_size=VOCAB,
            hidden_size=48,
            num_hidden_layers=2,
            state_size=8,
            expand=2,
            initializer_range=0.2,
            tie_word_embeddings=False,
        )
    if kind == "jamba":  # Mamba1 with experts in layers 0 and 2, attention (no rotary) with a dense MLP in layer 1
        return transformers.JambaConfig(
            **{**common, "num_hidden_layers": 3, "initializer_range": 0.1},  # the Mamba1 layers large enough to matter
            attn_layer_period=3,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=0,
            num_experts=4,
            num_experts_per_tok=2,
            mamba_d_state=8,
            mamba_dt_rank=4,
            mamba_expand=2,
        )
    if kind == "kimi_linear":  # KDA in layers 0 and 2, MLA attention (no rotary) in layer 1, dense MLPs
        return transformers.KimiLinearConfig(
            **{**common, "num_hidden_layers": 3, "num_key_value_heads": 4, "initializer_range": 0.1},
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            mlp_layer_types=["dense"] * 3,  # experts flip their routing under bf16 (and take no float64)
            linear_num_heads=4,
            linear_head_dim=8,
            linear_conv_kernel_dim=4,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=12,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
    if kind == "minimax":  # lightning attention in layers 0 and 2 (blocks of 5 tokens), softmax attention in 1
        return transformers.MiniMaxConfig(
            **{**common, "num_hidden_layers": 3},
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            block_size=5,  # blocks cut the chunks (8, 12, 16, 24 tokens) and start mid-chunk
            num_local_experts=2,
            num_experts_per_tok=2,  # every token takes both experts: no routing to flip under bf16
        )
    if kind == "recurrent_gemma":  # RG-LRU blocks in layers 0 and 2, sliding-window attention (7 tokens) in 1
        return transformers.RecurrentGemmaConfig(
            **{**common, "num_hidden_layers": 3},
            block_types=["recurrent", "attention", "recurrent"],
            attention_window_size=7,
            conv1d_width=4,
            use_cache=False,  # with a cache the blocks keep their states on the module
        )
    raise ValueError(kind)


def build(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(kind), attn_implementation="eager").eval()


def tokens(batch: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def documents_alone_history(model, rows, documents, steps: int, lr: float, max_norm: float) -> torch.Tensor:
    """One process, every packed document run by itself, SGD with clipping: per-step (loss, gradient norm).

    ``rows(step)`` gives the step's ``[batch, seq]`` token ids; ``documents[b]`` the document lengths of row b.
    The loss is the token mean over every document of the step, as seqpar normalises it.
    """
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    history = []
    for step in range(steps):
        total, count = 0.0, 0
        for row, docs in zip(rows(step), documents):
            start = 0
            for n in docs:
                doc = row[None, start : start + n]
                logits = model(input_ids=doc).logits[:, :-1]
                total = total + torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1), doc[:, 1:].flatten(), reduction="sum"
                )
                count, start = count + n - 1, start + n
        loss = total / count
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
        history.append(torch.stack([loss.detach(), norm]))
    return torch.stack(history)
