"""How the zoo's tiny configs keep a family's layer pattern in at most ``MAX_LAYERS`` layers.

``shrink_layers`` picks the layers to keep and renumbers the fields that name layers (``_tiny_config``'s helper).
"""

from __future__ import annotations

from typing import Any

MAX_LAYERS = 4


LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "depth")


def _scaled_layer(layer: dict[str, Any], fields: dict[str, Any], old_fields: dict[str, Any]) -> dict[str, Any]:
    """One layer's own sizes scaled as the config's same sizes were (a global layer's heads twice as wide stay so)."""
    scaled = {}
    for key, value in layer.items():
        base_old, base_new = old_fields.get(key), fields.get(key)
        if isinstance(value, int) and isinstance(base_old, int) and isinstance(base_new, int) and base_old:
            value = max(1, base_new * value // base_old)
        scaled[key] = value
    # MLA: a layer whose own query/key head (no-rotary + rotary part) was the config's head_dim still is (Dots3)
    nope, rope = layer.get("qk_nope_head_dim"), layer.get("qk_rope_head_dim", old_fields.get("qk_rope_head_dim"))
    head, old_head = fields.get("head_dim"), layer.get("head_dim", old_fields.get("head_dim"))
    new_rope = scaled.get("qk_rope_head_dim", fields.get("qk_rope_head_dim"))
    if all(isinstance(v, int) for v in (nope, rope, head, old_head, new_rope)) and nope + rope == old_head:
        scaled["qk_nope_head_dim"] = max(1, scaled.get("head_dim", head) - new_rope)
    return scaled


def shrink_layers(fields: dict[str, Any], names: dict[str, str], old_fields: dict[str, Any]) -> None:
    """Cut the layer count, keeping one layer of each kind every per-layer pattern has (and at least 2)."""
    count_key = next((names.get(k, k) for k in LAYER_COUNTS if isinstance(fields.get(names.get(k, k)), int)), None)
    if count_key is None:
        return
    old = fields[count_key]
    patterns = {k: v for k, v in fields.items() if isinstance(v, list | tuple) and len(v) == old and old > 1}
    patterns |= {
        k: v for k, v in fields.items() if isinstance(v, str) and len(v) == old and old > 1 and k != "model_type"
    }
    per_layer = fields.get("per_layer_config")
    if isinstance(per_layer, dict) and per_layer:  # a heterogeneous config: each listed layer's own fields
        by_index = {int(k): v for k, v in per_layer.items()}
        patterns["per_layer_config"] = [by_index.get(i) for i in range(old)]
    # lists of layer ids: per-layer references to another layer (Kolibri's kv_source_layers) and sets of layers
    # (Zamba2's hybrid_layer_ids, Kolibri's index_layers): each layer's kind says whether it refers or belongs
    references = {
        k: v
        for k, v in patterns.items()
        if _layer_ids(k, v, old) and all(x <= i for i, x in enumerate(v)) and not set(v) <= {0, 1}
    }
    # (cross-attention layers, which run only beside another modality's states, stay out of a text model as before)
    members = {
        k: v
        for k, v in fields.items()
        if k not in patterns and _layer_ids(k, v, old) and len(set(v)) == len(v) and "cross" not in k
    }
    kinds = [p for k, p in patterns.items() if k not in references]
    kinds += [["self" if v == i else "other" for i, v in enumerate(p)] for p in references.values()]
    kinds += [[i in set(ids) for i in range(old)] for ids in members.values()]
    keep = _kept_layers(kinds, old)
    if fields.get("num_kv_shared_layers"):  # the last layers read earlier layers' caches: one of each kind again
        keep = sorted(keep + [old - len(keep) + i for i in range(len(keep))])
    fields[count_key] = len(keep)
    first_of_kind: dict[tuple[str, ...], int] = {}
    for i in range(old):
        first_of_kind.setdefault(tuple(repr(p[i]) for p in kinds), i)
    for key, pattern in references.items():  # a reference to a layer cut goes to the kept layer of its kind
        kept = [v if v in keep else first_of_kind[tuple(repr(p[v]) for p in kinds)] for v in pattern]
        patterns[key] = type(pattern)(keep.index(v) if v in keep else v for v in kept)
    for key, ids in members.items():
        fields[key] = type(ids)(keep.index(i) for i in ids if i in keep)
    for key, pattern in patterns.items():
        if key in references:
            fields[key] = type(pattern)(pattern[i] for i in keep)
            continue
        cut = [pattern[i] for i in keep]
        if key == "per_layer_config":
            fields[key] = {str(i): _scaled_layer(layer, fields, old_fields) for i, layer in enumerate(cut) if layer}
        else:
            fields[key] = "".join(cut) if isinstance(pattern, str) else type(pattern)(cut)
    for key, value in list(fields.items()):
        if key.endswith("_layer_period") and isinstance(value, int) and value > len(keep):
            fields[key] = len(keep)
        elif key.endswith("_layer_offset") and isinstance(value, int):
            period = fields.get(key.replace("_offset", "_period"), len(keep))
            fields[key] = value % max(1, min(period, len(keep)))


def _layer_ids(key: str, value: Any, count: int) -> bool:
    """Whether ``value`` is a list of layer ids of a config of ``count`` layers (its name says layers)."""
    if "layer" not in key or not isinstance(value, list | tuple) or not value:
        return False
    return all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < count for v in value)


def _kept_layers(patterns: list[list[Any] | str], old: int) -> list[int]:
    """Layer indices to keep: the first layer of each kind across the patterns, in order, padded to 2 layers."""
    keep: list[int] = []
    seen: set[tuple[str, ...]] = set()
    for i in range(old):
        kind = tuple(repr(p[i]) for p in patterns)
        if kind not in seen:
            seen.add(kind)
            keep.append(i)
    for i in range(old):
        if len(keep) >= 2:
            break
        if i not in keep:
            keep.append(i)
    return sorted(keep)[:MAX_LAYERS] if len(keep) > MAX_LAYERS else sorted(keep)
