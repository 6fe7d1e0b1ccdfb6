"""The model ``seqpar train`` trains: the embedded small Llama, or a local Hugging Face model or config.

Built from configs only (nothing is downloaded); weights are loaded when the model directory has them.
"""

from __future__ import annotations

import contextlib
import json
import os

import torch

from seqpar.errors import SeqparInputError
from seqpar.train.config import TrainConfig

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def model_config(config: TrainConfig, vocab_size: int) -> object:
    """The transformers config of the run (cheap: no weights), checked against the sequence lengths.

    Raises:
        SeqparInputError: an unreadable config, or a sequence length beyond its max_position_embeddings.
    """
    import transformers

    # the passkey evaluation also runs at eval_lengths; data files train and stop at seq_len
    longest = config.seq_len if config.data else max([config.seq_len, *(config.eval_lengths or [2 * config.seq_len])])
    if config.model is None:
        cfg = transformers.LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=3 * config.hidden_size,
            num_hidden_layers=config.layers,
            num_attention_heads=config.heads,
            num_key_value_heads=max(1, config.heads // 2),
            max_position_embeddings=max(4096, longest),
            tie_word_embeddings=False,
        )
    else:
        path = config.model
        try:
            if os.path.isfile(path):
                with open(path) as f:
                    values = json.load(f)
                model_type = values.pop("model_type", None)
                if model_type is None:
                    raise ValueError("config.json has no model_type")
                cfg = transformers.AutoConfig.for_model(model_type, **values)
            else:
                cfg = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        except Exception as error:
            raise SeqparInputError(f"cannot read a model config from {path}: {str(error).splitlines()[0]}") from error
    limit = getattr(cfg, "max_position_embeddings", None)
    if limit is not None and longest > limit:
        raise SeqparInputError(
            f"sequence length {longest} is longer than the model takes (max_position_embeddings = {limit}); "
            "lower --seq-len / --eval-lengths or use a model with longer positions"
        )
    if getattr(cfg, "vocab_size", vocab_size) < vocab_size:
        raise SeqparInputError(f"the tokenizer has {vocab_size} tokens but the model only {cfg.vocab_size}")
    return cfg


def import_model_code(cfg: object) -> None:
    """Import the modules of the model classes transformers maps ``cfg`` to (a launcher does, before it forks
    its ranks: Note [forked ranks]); nothing is built."""
    import transformers

    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForImageTextToText):
        with contextlib.suppress(KeyError):
            auto._model_mapping[type(cfg)]


def build_model(config: TrainConfig, vocab_size: int, *, multimodal: bool = False) -> torch.nn.Module:
    """The model on the CPU (weights from the model directory when present, else seeded random), before
    ``seqpar.parallelize`` applies the parallel axes and the memory features.

    Args:
        config: the run's settings (the model directory or config file, the seed).
        vocab_size: the tokenizer's size, checked against the model's.
        multimodal: build the vision-language model (``AutoModelForImageTextToText``) rather than a decoder.

    Returns:
        The model, in float32.
    """
    import transformers

    cfg = model_config(config, vocab_size)
    auto = transformers.AutoModelForImageTextToText if multimodal else transformers.AutoModelForCausalLM
    torch.manual_seed(config.seed)
    has_weights = config.model is not None and any(
        os.path.exists(os.path.join(config.model, name)) for name in _WEIGHT_FILES
    )
    if has_weights:
        model = auto.from_pretrained(config.model, config=cfg, local_files_only=True, dtype=torch.float32)
    else:
        model = auto.from_config(cfg, dtype=torch.float32)
    return model
