"""Tiny vision-language models from configs and their samples: whole rows as the processors make them.

Pixels come from the families' own (PIL) image processors on random images; the rows hold the processors'
placeholder runs between text tokens, as the chat templates lay them out.
"""

from __future__ import annotations

import numpy as np
import torch
import transformers

VOCAB = 96
IMAGE, VIDEO, START, END = 90, 91, 92, 93  # placeholder and delimiter ids (the processors' tokens)
_TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    attention_dropout=0.0,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
FAMILIES = (
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_5",
    "qwen3_5_moe",
    "gemma3",
    "llava",
    "llava_onevision",
    "llava_next_video",
    "idefics3",
    "smolvlm",
    "internvl",
)
_LINEAR = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)  # Qwen3.5's gated DeltaNet layers
QWEN_PATCH2 = "qwen2_5_vl_patch2"
"""Qwen2.5-VL's variant at patch 2 (merge 2, temporal patch 2), mRoPE sections [1, 1, 2], vision windows of 8
pixels: images of 8 x 8 and 8 x 16 pixels (grids [1, 4, 4] and [1, 4, 8]); its collator ignores the vision
markers' labels too and passes no token types. Not in FAMILIES (a model type's variant, for the Trainer cases)."""
_PINPOINTS = [[16, 16], [16, 32], [32, 16]]  # LLaVA's "anyres" grids: an image becomes 1-2 crops and a thumbnail


def _qwen_vision(family: str) -> dict:
    common = dict(depth=2, num_heads=4, patch_size=4, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    if family == "qwen2_vl":
        return dict(common, embed_dim=32, hidden_size=32, mlp_ratio=2, in_chans=3)
    if family == "qwen2_5_vl":
        return dict(
            common, hidden_size=32, intermediate_size=64, out_hidden_size=32, window_size=16, fullatt_block_indexes=[1]
        )
    qwen3 = dict(common, hidden_size=32, intermediate_size=64, out_hidden_size=32, num_position_embeddings=64)
    return dict(qwen3, deepstack_visual_indexes=[0, 1]) if family == "qwen3_vl" else qwen3


def config(family: str) -> transformers.PretrainedConfig:
    """The family's tiny config: 2 text layers (GQA 4/2 heads), a 2-block vision tower."""
    ids = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    if family == QWEN_PATCH2:
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}
        vision = dict(_qwen_vision("qwen2_5_vl"), patch_size=2, window_size=8)
        return transformers.Qwen2_5_VLConfig(text_config=dict(_TEXT, rope_parameters=rope), vision_config=vision, **ids)
    if family.startswith("qwen"):
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
        qwen3 = family not in ("qwen2_vl", "qwen2_5_vl")
        if qwen3:
            rope["mrope_interleaved"] = True
        text = dict(_TEXT, rope_parameters=rope, **({"head_dim": 8} if qwen3 else {}))
        if family.startswith("qwen3_5"):  # a gated DeltaNet layer, then an attention layer
            text.update(_LINEAR, layer_types=["linear_attention", "full_attention"])
        if family == "qwen3_5_moe":
            experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
            text.update(experts, shared_expert_intermediate_size=32)
        cls = transformers.AutoConfig.for_model(family).__class__
        return cls(text_config=text, vision_config=_qwen_vision(family), **ids)
    if family == "gemma4":  # the zoo's tiny Gemma 4 (sliding and full layers, per-layer inputs), its images blocks
        from seqpar.models.zoo import tiny_config

        cfg = tiny_config("gemma4")
        cfg.text_config.use_bidirectional_attention = "vision"  # on its sliding layers (Gemma 4's larger models')
        cfg.image_token_id, cfg.video_token_id, cfg.boi_token_id, cfg.eoi_token_id = IMAGE, VIDEO, START, END
        return cfg
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=16,
        patch_size=4,
        attention_dropout=0.0,
    )
    if family == "gemma3":
        text = dict(
            _TEXT,
            head_dim=8,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        )
        return transformers.Gemma3Config(
            text_config=text,
            vision_config=vision,
            mm_tokens_per_image=4,
            image_token_id=IMAGE,
            boi_token_index=START,
            eoi_token_index=END,
        )
    llama, clip, siglip = dict(_TEXT, model_type="llama"), dict(vision, model_type="clip_vision_model"), vision
    if family == "llava":
        return transformers.LlavaConfig(
            text_config=llama,
            vision_config=clip,
            image_token_id=IMAGE,
            projector_hidden_act="gelu",
            vision_feature_layer=-1,
        )
    if family == "llava_onevision":
        return transformers.LlavaOnevisionConfig(
            text_config=dict(_TEXT, model_type="qwen2"),
            vision_config=dict(siglip, model_type="siglip_vision_model"),
            image_token_id=IMAGE,
            video_token_id=VIDEO,
            vision_feature_layer=-1,
            image_grid_pinpoints=_PINPOINTS,
        )
    if family == "llava_next_video":
        return transformers.LlavaNextVideoConfig(
            text_config=llama,
            vision_config=clip,
            image_token_id=IMAGE,
            video_token_id=VIDEO,
            vision_feature_layer=-1,
            image_grid_pinpoints=_PINPOINTS,
            spatial_pool_stride=2,
        )
    if family in ("idefics3", "smolvlm"):  # each 16 x 16 tile becomes 4 tokens (pixel shuffle by 2)
        cls = transformers.Idefics3Config if family == "idefics3" else transformers.SmolVLMConfig
        return cls(text_config=llama, vision_config=siglip, image_token_id=IMAGE, scale_factor=2)
    if family == "internvl":  # each 16 x 16 patch becomes 4 tokens (pixel shuffle by 0.5)
        return transformers.InternVLConfig(
            text_config=dict(_TEXT, model_type="qwen2"),
            vision_config=dict(vision, image_size=[16, 16], patch_size=[4, 4]),
            image_token_id=IMAGE,
            downsample_ratio=0.5,
        )
    raise ValueError(f"no tiny config for {family}")


def build(family: str, seed: int = 0) -> torch.nn.Module:
    """The family's tiny ``...ForConditionalGeneration`` with seeded random weights, eager attention."""
    torch.manual_seed(seed)
    cfg = config(family)
    return transformers.AutoModelForImageTextToText.from_config(cfg, attn_implementation="eager").float().eval()


def _images(sizes: list[tuple[int, int]], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]


def _row(runs: list[int], texts: list[int], rng: np.random.Generator, delimit: bool = True) -> list[int]:
    """Text, then for each image its placeholder run (between START and END when ``delimit``), then text."""
    row = list(rng.integers(3, IMAGE - 1, texts[0]))
    for n, t in zip(runs, texts[1:], strict=True):
        image = [START, *[IMAGE] * n, END] if delimit else [IMAGE] * n
        row += image + list(rng.integers(3, IMAGE - 1, t))
    return row


def sample(family: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Two whole rows with images of different sizes, the second right-padded, as the model is called."""
    rng = np.random.default_rng(seed)
    if family.startswith("qwen"):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        processor = Qwen2VLImageProcessorPil(
            patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=8 * 8, max_pixels=32 * 32
        )
        images = _images([(16, 24), (16, 16), (8, 16)], seed)
        pixels = processor(images=images, return_tensors="pt")
        runs = (pixels["image_grid_thw"].prod(-1) // 4).tolist()
        rows = [_row(runs[:2], [5, 4, 6], rng), _row(runs[2:], [3, 7], rng)]
        extra = {"pixel_values": pixels["pixel_values"], "image_grid_thw": pixels["image_grid_thw"]}
        if family in ("qwen2_vl", "qwen2_5_vl"):  # the second row also holds a video of 2 temporal patches
            frames = processor(images=_images([(16, 16)] * 2, seed + 1), return_tensors="pt")
            grid = frames["image_grid_thw"][:1].clone()
            grid[0, 0] = 2  # the frames' patches, time-major as the video processor orders them
            extra.update(pixel_values_videos=frames["pixel_values"], video_grid_thw=grid)
            rows[1] += [START, *([VIDEO] * int(grid.prod() // 4)), END, *rng.integers(3, IMAGE - 1, 3).tolist()]
            if family == "qwen2_5_vl":  # 0.5 s per temporal patch: video positions step by 25 * 0.5
                extra["second_per_grid_ts"] = torch.tensor([0.5])
        else:  # Qwen3-VL: each temporal patch of the video is its own run, after its timestamp's text tokens
            frames = processor(images=_images([(16, 16)] * 2, seed + 1), return_tensors="pt")
            grid = frames["image_grid_thw"][:1].clone()
            grid[0, 0] = 2
            extra.update(pixel_values_videos=frames["pixel_values"], video_grid_thw=grid)
            per_frame = int(grid[0, 1:].prod() // 4)
            for _ in range(2):  # "<t seconds>" as two text tokens, then the frame's placeholders
                rows[1] += [*rng.integers(3, IMAGE - 1, 2).tolist(), START, *([VIDEO] * per_frame), END]
            rows[1] += rng.integers(3, IMAGE - 1, 2).tolist()
    elif family == "gemma3":
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        processor = Gemma3ImageProcessorPil(size={"height": 16, "width": 16})
        pixels = processor(images=_images([(20, 16), (16, 12), (16, 16), (12, 20)], seed), return_tensors="pt")
        rows = [_row([4, 4], [5, 3, 6], rng), _row([4, 4], [3, 6, 2], rng)]  # the rows' images at other tokens
        extra = {"pixel_values": pixels["pixel_values"]}
    elif family == "llava":
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        processor = CLIPImageProcessorPil(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
        pixels = processor(images=_images([(20, 16), (16, 24), (16, 16)], seed), return_tensors="pt")
        rows = [_row([16, 16], [4, 3, 5], rng), _row([16], [6, 9], rng)]
        extra = {"pixel_values": pixels["pixel_values"]}
    else:
        rows, extra = _other_rows(family, seed, rng)
    length = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (length - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (length - len(r)) for r in rows])
    batch = {"input_ids": ids, "attention_mask": mask, **extra}
    if family.startswith("qwen"):
        batch["mm_token_type_ids"] = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
    if family == "gemma3":
        batch["token_type_ids"] = (ids == IMAGE).long()
    return batch


def _feature_counts(family: str, extra: dict[str, torch.Tensor]) -> tuple[list[int], list[int]]:
    """The placeholder tokens each image and each video of ``extra`` fills, as the family's model counts them
    (anyres crops, newline tokens, pooled frames, dropped padding tiles)."""
    model = transformers.AutoModelForImageTextToText.from_config(config(family), attn_implementation="eager").model
    with torch.no_grad():
        images = videos = ()
        if family in ("idefics3", "smolvlm"):  # one entry per row: its tiles' tokens
            images = [
                model.get_image_features(pixel_values=p[None], pixel_attention_mask=m[None]).pooler_output
                for p, m in zip(extra["pixel_values"], extra["pixel_attention_mask"], strict=True)
            ]
        elif family == "internvl":
            images = model.get_image_features(pixel_values=extra["pixel_values"]).pooler_output.split(
                extra.pop("num_patches").tolist()
            )
        else:
            images = model.get_image_features(extra["pixel_values"], extra["image_sizes"]).pooler_output
            if "pixel_values_videos" in extra:
                videos = model.get_video_features(extra["pixel_values_videos"]).pooler_output

    def tokens(features: torch.Tensor | tuple) -> int:
        if isinstance(features, torch.Tensor):
            return int(features.shape[:-1].numel())
        return sum(tokens(f) for f in features)

    return [tokens(f) for f in images], [tokens(f) for f in videos]


def _other_rows(family: str, seed: int, rng: np.random.Generator) -> tuple[list[list[int]], dict[str, torch.Tensor]]:
    """Two rows of images (and a video for LLaVA-Next-Video) for the LLaVA-OneVision, LLaVA-Next-Video,
    Idefics3 / SmolVLM and InternVL families, pixels from the families' own PIL image processors."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    sizes = [(20, 16), (16, 34), (16, 16)]  # row 0 holds the first two images, row 1 the third
    if family in ("idefics3", "smolvlm"):  # images split into 16 x 16 tiles plus a global view, per row
        cls = Idefics3ImageProcessorPil if family == "idefics3" else SmolVLMImageProcessorPil
        processor = cls(size={"longest_edge": 32}, max_image_size={"longest_edge": 16})
        images = _images(sizes, seed)
        pixels = processor(images=[images[:2], images[2:]], return_tensors="pt")
        extra = {"pixel_values": pixels["pixel_values"], "pixel_attention_mask": pixels["pixel_attention_mask"]}
        counts, _ = _feature_counts(family, extra)
        return [_row([counts[0]], [5, 4], rng), _row([counts[1]], [3, 6], rng)], extra
    if family == "internvl":
        processor = GotOcr2ImageProcessorPil(
            size={"height": 16, "width": 16}, crop_to_patches=True, min_patches=1, max_patches=3
        )
        pixels = processor(images=_images(sizes, seed), return_tensors="pt")
        extra = {"pixel_values": pixels["pixel_values"], "num_patches": pixels["num_patches"]}
    else:
        cls = LlavaOnevisionImageProcessorPil if family == "llava_onevision" else LlavaNextImageProcessorPil
        size = {"height": 16, "width": 16} if family == "llava_onevision" else {"shortest_edge": 16}
        processor = cls(size=size, crop_size={"height": 16, "width": 16}, image_grid_pinpoints=_PINPOINTS)
        pixels = processor(images=_images(sizes, seed), return_tensors="pt")
        extra = {"pixel_values": pixels["pixel_values"], "image_sizes": pixels["image_sizes"]}
        if family == "llava_next_video":  # 4 frames, each through the CLIP processor, as its video processor does
            frames = CLIPImageProcessorPil(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
            extra["pixel_values_videos"] = frames(images=_images([(16, 20)] * 4, seed + 1), return_tensors="pt")[
                "pixel_values"
            ][None]
    images, videos = _feature_counts(family, extra)
    first = _row(images[:2], [5, 4, 3], rng)
    if videos:
        first += [VIDEO] * videos[0] + list(rng.integers(3, IMAGE - 1, 4))
    return [first, _row(images[2:], [3, 6], rng)], extra


def examples(family: str, count: int, seed: int) -> list[dict[str, object]]:
    """``count`` one-row samples of ``family`` for a dataset: token ids, the row's pixels (and grids), one or two
    images of different sizes between text runs of random lengths, as a processor makes them (``QWEN_PATCH2``:
    two images in the even rows, one in the odd ones)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(count):
        n_images = int(rng.integers(1, 3))
        if family == QWEN_PATCH2:  # every batch of two rows holds a row of one image and a row of two
            n_images = 2 - i % 2
        texts = [int(t) for t in rng.integers(2, 8, n_images + 1)]
        if family.startswith("qwen"):
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

            patch = 2 if family == QWEN_PATCH2 else 4
            processor = Qwen2VLImageProcessorPil(
                patch_size=patch, merge_size=2, temporal_patch_size=2, min_pixels=8 * 8, max_pixels=32 * 32
            )
            choices = [(8, 8), (8, 16)] if family == QWEN_PATCH2 else [(16, 24), (16, 16), (8, 16), (24, 16)]
            sizes = [choices[int(k)] for k in rng.integers(0, len(choices), n_images)]
            pixels = processor(images=_images(sizes, seed * 1000 + i), return_tensors="pt")
            runs = (pixels["image_grid_thw"].prod(-1) // 4).tolist()
            extra = {"pixel_values": pixels["pixel_values"], "image_grid_thw": pixels["image_grid_thw"]}
        elif family == "gemma3":
            from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

            processor = Gemma3ImageProcessorPil(size={"height": 16, "width": 16})
            pixels = processor(images=_images([(20, 16)] * n_images, seed * 1000 + i), return_tensors="pt")
            runs, extra = [4] * n_images, {"pixel_values": pixels["pixel_values"]}
        elif family == "gemma4":  # its processor's patches with their positions, 70 soft tokens an image
            from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

            processor = Gemma4ImageProcessorPil(patch_size=16, max_soft_tokens=70, pooling_kernel_size=3)
            pixels = processor(images=_images([(40, 32)] * n_images, seed * 1000 + i), return_tensors="pt")
            runs = pixels["num_soft_tokens_per_image"].tolist()
            extra = {k: pixels[k] for k in ("pixel_values", "image_position_ids")}
        else:
            raise ValueError(f"no dataset rows for {family}")
        rows.append({"input_ids": _row(runs, texts, rng), **extra})
    return rows


def collator(family: str):
    """A multimodal collator for ``examples``: right-padded rows, the rows' pixels (and grids) in row order, the
    family's token types, and labels with padding and image placeholders ignored (``QWEN_PATCH2``: the vision
    markers' too, and no token types)."""
    ignored = (IMAGE, START, END) if family == QWEN_PATCH2 else (IMAGE,)

    def collate(features: list[dict[str, object]]) -> dict[str, torch.Tensor]:
        width = max(len(f["input_ids"]) for f in features)
        ids = torch.tensor([f["input_ids"] + [0] * (width - len(f["input_ids"])) for f in features])
        mask = torch.tensor([[1] * len(f["input_ids"]) + [0] * (width - len(f["input_ids"])) for f in features])
        labels = ids.masked_fill(mask == 0, -100).masked_fill(torch.isin(ids, torch.tensor(ignored)), -100)
        batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        batch["pixel_values"] = torch.cat([f["pixel_values"] for f in features])
        if family.startswith("qwen"):
            batch["image_grid_thw"] = torch.cat([f["image_grid_thw"] for f in features])
        if family == "gemma4":
            batch["image_position_ids"] = torch.cat([f["image_position_ids"] for f in features])
            batch["mm_token_type_ids"] = (ids == IMAGE).int()
        if family.startswith("qwen") and family != QWEN_PATCH2:
            batch["mm_token_type_ids"] = (ids == IMAGE).int()
        if family == "gemma3":
            batch["token_type_ids"] = (ids == IMAGE).long()
        return batch

    return collate


_SPECIAL = {"<pad>": 0, "<bos>": 1, "<eos>": 2}
_MARKS = ("<image_soft_token>", "<video>", "<start_of_image>", "<end_of_image>", "<start_of_turn>", "<end_of_turn>")
_GEMMA3_TEMPLATE = (  # Gemma 3's turn and image markers; text is space-separated words
    "{% for m in messages %}<start_of_turn>{{ m['role'] }} {% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<start_of_image>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %} "
    "{% endfor %}<end_of_turn> {% endfor %}"
)


def processor(family: str):
    """A real ``Gemma3Processor`` built locally: a word-level tokenizer over the tiny vocabulary (words ``w3`` ..
    ``w89``, the roles, Gemma 3's markers at 90-95), the family's PIL image processor, a chat template; each image
    becomes START, 4 IMAGE tokens, END as the tiny model expects. (Qwen's processors need torchvision.)"""
    if family != "gemma3":
        raise ValueError(f"no local processor for {family}")
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    vocab = {**_SPECIAL, **{f"w{i}": i for i in range(3, IMAGE - 2)}, "user": IMAGE - 2, "assistant": IMAGE - 1}
    vocab.update({mark: IMAGE + i for i, mark in enumerate(_MARKS)})
    words = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.add_special_tokens([AddedToken(t, special=True) for t in (*_SPECIAL, *_MARKS)])
    marks = {"image_token": _MARKS[0], "boi_token": _MARKS[2], "eoi_token": _MARKS[3]}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", extra_special_tokens=marks
    )
    images = Gemma3ImageProcessorPil(size={"height": 16, "width": 16})
    return transformers.Gemma3Processor(
        image_processor=images, tokenizer=tokenizer, chat_template=_GEMMA3_TEMPLATE, image_seq_length=4
    )


def conversations(count: int, seed: int) -> list[dict[str, object]]:
    """``count`` conversational vision samples as TRL's VLM datasets hold them: ``messages`` (a user turn, an
    assistant turn; string contents) and ``images`` (1-2 PIL images of different sizes, placed before the user's
    text by TRL's collator)."""
    from PIL import Image

    rng = np.random.default_rng(seed)

    def words(n: int) -> str:
        return " ".join(f"w{int(i)}" for i in rng.integers(3, IMAGE - 2, n))

    rows = []
    for i in range(count):
        sizes = [((16, 24), (20, 16), (12, 12))[int(k)] for k in rng.integers(0, 3, int(rng.integers(1, 3)))]
        images = [Image.fromarray(a) for a in _images(sizes, seed * 1000 + i)]
        turns = [
            {"role": "user", "content": words(int(rng.integers(2, 7)))},
            {"role": "assistant", "content": words(int(rng.integers(3, 9)))},
        ]
        rows.append({"messages": turns, "images": images})
    return rows


def _runs(marks: torch.Tensor) -> int:
    """The number of runs of True in a 1-D mask."""
    return int((torch.diff(marks.long(), prepend=torch.zeros(1, dtype=torch.long)) == 1).sum())


def documents(family: str, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """The rows of ``sample(family, seed)`` as one-row samples without padding, each with its own pixels (and
    grids, video, token types): the documents a packed row is made of. Qwen2/2.5-VL, Gemma 3 and LLaVA."""
    batch = sample(family, seed)
    images = videos = 0  # images and videos taken by earlier rows
    patches = frames = 0  # their rows of pixel_values / pixel_values_videos (Qwen)
    docs = []
    for b in range(batch["input_ids"].shape[0]):
        real = batch["attention_mask"][b].bool()
        ids = batch["input_ids"][b, real]
        n_images, n_videos = _runs(ids == IMAGE), _runs(ids == VIDEO)
        doc = {"input_ids": ids[None]}
        if family.startswith("qwen"):
            grids = batch["image_grid_thw"][images : images + n_images]
            size = int(grids.prod(-1).sum())
            doc.update(pixel_values=batch["pixel_values"][patches : patches + size], image_grid_thw=grids)
            patches += size
            if n_videos:
                grids = batch["video_grid_thw"][videos : videos + n_videos]
                size = int(grids.prod(-1).sum())
                doc.update(pixel_values_videos=batch["pixel_values_videos"][frames : frames + size])
                doc["video_grid_thw"] = grids
                if "second_per_grid_ts" in batch:
                    doc["second_per_grid_ts"] = batch["second_per_grid_ts"][videos : videos + n_videos]
                frames += size
            doc["mm_token_type_ids"] = batch["mm_token_type_ids"][b, real][None]
        elif family in ("gemma3", "llava"):
            doc["pixel_values"] = batch["pixel_values"][images : images + n_images]
            if family == "gemma3":
                doc["token_type_ids"] = batch["token_type_ids"][b, real][None]
        else:
            raise ValueError(f"no documents for {family}")
        images, videos = images + n_images, videos + n_videos
        docs.append(doc)
    return docs


def positions(model: torch.nn.Module, doc: dict[str, torch.Tensor]) -> torch.Tensor:
    """One document's position ids as transformers computes them: ``[4, 1, S]`` for mRoPE families (the text
    positions first, then the model's ``get_rope_index``), ``[1, S]`` otherwise."""
    length = doc["input_ids"].shape[1]
    text = torch.arange(length)[None]
    if not hasattr(model.model, "get_rope_index"):
        return text
    keys = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts", "mm_token_type_ids")
    mrope, _ = model.model.get_rope_index(doc["input_ids"], **{k: doc[k] for k in keys if k in doc})
    return torch.cat([text[None], mrope])


def pack(
    model: torch.nn.Module, rows: list[list[dict[str, torch.Tensor]]], multiple: int = 1
) -> dict[str, torch.Tensor]:
    """Whole rows each packing its documents one after another, right-padded to the longest (rounded up to a
    ``multiple``): the call's ``input_ids``, ``attention_mask``, ``position_ids`` (each document numbered from 0),
    pixels and grids in row order, token types."""
    width = max(sum(d["input_ids"].shape[1] for d in docs) for docs in rows)
    width += -width % multiple
    flat = [d for docs in rows for d in docs]
    batch: dict[str, torch.Tensor] = {}
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"):
        if any(key in d for d in flat):
            batch[key] = torch.cat([d[key] for d in flat if key in d])
    per_row = {"input_ids": [], "attention_mask": [], "position_ids": []}
    types = [k for k in ("mm_token_type_ids", "token_type_ids") if k in flat[0]]
    per_row.update({k: [] for k in types})
    for docs in rows:
        length = sum(d["input_ids"].shape[1] for d in docs)
        pad = width - length
        per_row["input_ids"].append(torch.cat([d["input_ids"][0] for d in docs] + [torch.zeros(pad, dtype=torch.long)]))
        per_row["attention_mask"].append(torch.tensor([1] * length + [0] * pad))
        where = torch.cat([positions(model, d)[..., 0, :] for d in docs], dim=-1)
        per_row["position_ids"].append(torch.nn.functional.pad(where, (0, pad)))
        for k in types:
            per_row[k].append(torch.cat([d[k][0] for d in docs] + [torch.zeros(pad, dtype=docs[0][k].dtype)]))
    batch.update({k: torch.stack(v, dim=-2) for k, v in per_row.items()})
    return batch
