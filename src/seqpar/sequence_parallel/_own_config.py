"""A prepared model's own copy of its config, so that the caller's config object stays as it was.

``own_config`` gives a model the copy; ``config_tree`` lists a config and its sub-configs.

Note [the model's own config]
    transformers models share the config object they were built from (``from_config`` and ``__init__`` keep
    it, and many submodules hold it as ``self.config``), and the attention implementation is a field of
    that config. Setting it in place would switch every other model built from the same object (a
    one-process reference, a DPO reference model) to seqpar's attention, which then raises for want of its
    context. So ``prepare_model`` first gives the model a deep copy: every module attribute that is the old
    config, or one of its sub-configs, is pointed at the copy's counterpart, and only the copy is changed.
    The caller's config stays as it was; ``model.config`` is the copy (``save_pretrained`` writes it).
"""

from __future__ import annotations

import copy

import torch

from seqpar.errors import SeqparInputError

_OWN_CONFIG_ATTR = "_seqpar_own_config"  # the config copy prepare_model gave the model


def config_tree(config: object) -> list[object]:
    """A config and its sub-configs at any depth, each once, in a fixed order (configs are not hashable)."""
    found: list[object] = []
    pending = [config]
    while pending:
        one = pending.pop(0)
        if any(one is seen for seen in found):
            continue
        found.append(one)
        pending.extend(s for key in getattr(one, "sub_configs", {}) if (s := getattr(one, key, None)) is not None)
    return found


def own_config(model: torch.nn.Module) -> None:
    """Give the model a copy of its config, shared by none of the caller's objects (Note [the model's own config])."""
    old = model.config
    if getattr(model, _OWN_CONFIG_ATTR, None) is old:  # prepared before: the copy is the model's already
        return
    new = copy.deepcopy(old)
    # deepcopy keeps the sharing within the config, so the two trees pair up in the same order
    pairs = {id(a): (a, b) for a, b in zip(config_tree(old), config_tree(new), strict=True)}
    for module in model.modules():
        for name, value in list(vars(module).items()):
            pair = pairs.get(id(value))
            if pair is not None and pair[0] is value:
                vars(module)[name] = pair[1]  # not a parameter or module: a plain attribute, set as such
    if model.config is not new:
        raise SeqparInputError(f"{type(model).__name__} keeps its config where seqpar cannot give it its own copy")
    setattr(model, _OWN_CONFIG_ATTR, new)
