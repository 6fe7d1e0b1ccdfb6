"""The one resolver of ``FAMILIES``: a model's decoder, layers, attention, MLPs, norms, embedding and head.

``anatomy(model)`` reads the model's ``config.model_type``, looks its family up (or reads it from the model: Note [read
anatomy]) and follows the entry's paths.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from seqpar.errors import SeqparInputError
from seqpar.models.derived import derive_family
from seqpar.models.families import FAMILIES, UNSERVED, Family

if TYPE_CHECKING:
    from torch import nn

# torch.nn is imported by the functions that look at a model: the planner reads this package's sizes and loads
# no torch (Note [torch-free planning], seqpar.planning)


@dataclass(frozen=True, eq=False)
class ModelAnatomy:
    """Where the parts of one model are (Note [model families]); the modules are the model's own."""

    family: Family
    decoder: nn.Module
    """The text decoder: its forward takes ``input_ids`` or ``inputs_embeds`` and ``position_ids``."""
    layers: nn.ModuleList
    """The decoder layers."""
    embedding: nn.Module
    norm: nn.Module | None
    """The final norm (None when the family names none)."""
    rotary: nn.Module | None
    """The rotary embedding (None when the family names none)."""
    head: nn.Module | None
    """The output head (None for a bare decoder without one)."""
    attention: tuple[nn.Module | None, ...]
    """Each layer's attention module, in layer order (None for a hybrid's layer without attention)."""
    mlps: tuple[nn.Module, ...]
    """Each layer's MLP (dense or a mixture of experts), in layer order (a hybrid's layer may have none)."""
    per_token: tuple[nn.Module, ...]
    """The layers' further blocks that act on each token alone (the entry's ``per_token`` paths)."""
    layer_norms: tuple[nn.Module, ...]
    """Every layer's norms, layer by layer."""
    mixers: tuple[nn.Module, ...]
    """Token mixers other than attention (a hybrid's convolutions and recurrences), layer by layer."""
    names: Mapping[int, str]
    """``id(module)`` -> qualified name in the model ``anatomy`` was given."""

    def name(self, module: nn.Module) -> str:
        """The qualified name of one of the model's modules (``model.layers.0.self_attn``).

        Args:
            module: a module of the model.

        Returns:
            Its name, "" for the model itself.

        Raises:
            SeqparInputError: a module that is not part of the model.
        """
        if id(module) not in self.names:
            raise SeqparInputError(f"{type(module).__name__} is not a module of this model")
        return self.names[id(module)]

    @property
    def moe_mlps(self) -> tuple[nn.Module, ...]:
        """The MLPs that are mixtures of experts (they hold the family's ``experts`` path)."""
        path = self.family.experts
        return tuple(m for m in self.mlps if path is not None and _get(m, path) is not None)

    @property
    def norms(self) -> tuple[nn.Module, ...]:
        """The layers' norms and the final norm."""
        return (*self.layer_norms, *([self.norm] if self.norm is not None else []))

    def undeclared(self) -> list[str]:
        """The modules of the decoder layers that the family entry does not account for and that could mix tokens
        (Note [declared layer parts]).

        Returns:
            One description per module, ``"model.layers.1.gate (Conv1d) in layer 1"``, in layer order.
        """
        from torch import nn

        windows = (nn.modules.conv._ConvNd, nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd)
        declared = set()
        for part in (*self.attention, *self.mlps, *self.per_token, *self.layer_norms, *self.mixers):
            if part is not None:
                declared |= {id(m) for m in part.modules()}
        inside = set()  # modules that hold a declared part
        for layer in self.layers:
            modules = dict(layer.named_modules())
            for name, module in modules.items():
                if id(module) in declared and name:
                    parts = name.split(".")
                    inside |= {id(modules[".".join(parts[:n])]) for n in range(len(parts))}
        found = []

        def visit(module: nn.Module, i: int) -> None:  # the outermost undeclared module that has parameters
            if id(module) in declared:
                return
            layer_own = module is self.layers[i]  # a layer's own parameters the entry says act per token pass
            own = any(not (layer_own and n in self.family.per_token) for n, _ in module.named_parameters(recurse=False))
            if (
                own
                or isinstance(module, windows)
                or (id(module) not in inside and next(module.parameters(), None) is not None)
            ):
                found.append(f"{self.name(module)} ({type(module).__name__}) in layer {i}")
                return
            for child in module.children():
                visit(child, i)

        for i, layer in enumerate(self.layers):
            visit(layer, i)
        return found


def _get(root: object, path: str) -> object:
    """``root.a.b`` for the path "a.b", or None where a part is missing."""
    for part in path.split("."):
        root = getattr(root, part, None)
        if root is None:
            return None
    return root


def family_of(model: object) -> Family | str:
    """The registered family of a model or config, or the reason there is none (a sentence).

    Args:
        model: a transformers model or config (anything with a ``model_type``, or a ``config`` that has one).

    Returns:
        The ``Family`` of its ``model_type``, the family read from a model that has no entry (Note [read
        anatomy]), or a sentence naming what is unknown.
    """
    from torch import nn

    config = getattr(model, "config", None) if isinstance(model, nn.Module) else model
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    name = type(model).__name__
    if not isinstance(model_type, str) or not model_type:
        return f"{name} has no config.model_type: seqpar knows model families by it (not a transformers model)"
    family = FAMILIES.get(model_type)
    if family is None and model_type in UNSERVED:
        return f"seqpar does not serve {model_type!r} models ({name}): {UNSERVED[model_type]}"
    if family is None and isinstance(model, nn.Module) and config is not None:
        derived = derive_family(model)  # Note [read anatomy]
        if isinstance(derived, str):
            return (
                f"seqpar has no entry for {model_type!r} models ({name}) and cannot read their anatomy: {derived}; "
                "describe it with seqpar.models.register_family (docs/design.md, Adding a model family)"
            )
        return derived
    if family is None:
        return (
            f"seqpar has no entry for {model_type!r} ({name}) and reads a family's anatomy only from a model, not "
            "from its config alone; describe it with seqpar.models.register_family (docs/design.md, Adding a model "
            "family)"
        )
    return family


def _part(owner: nn.Module, path: str | None, kind: type, where: str, missing: list[str]) -> nn.Module | None:
    """``owner``'s part at ``path`` (None when the path is None), or None with ``where.path`` noted as missing."""
    if path is None:
        return None
    found = _get(owner, path)
    if not isinstance(found, kind):
        missing.append(f"{where}{path}")
        return None
    return found


def _layer_parts(family: Family, layers: nn.ModuleList, missing: list[str], config: object = None) -> dict:
    """The per-layer parts: attention, MLPs, per-token blocks, norms and other mixers (missing paths noted).

    A family with other token mixers is a hybrid: each layer holds its attention or one of its mixers (or
    both), and an MLP or not, so a layer misses a part only when it has none of them. Where one path names
    several parts (Nemotron-H's ``mixer``), the layer's kind (``kinds``) says which it holds, read from the layer
    (``layer_kind``) or from the decoder's ``config`` (``kinds_field``).
    """
    from torch import nn

    kinds = dict(family.kinds)
    paths = [family.attention, *([family.mlp] if family.mlp else []), *family.mixers]
    shared = {path for path in paths if paths.count(path) > 1}  # the paths whose part the layer's kind decides
    attention, mlps, per_token, norms, mixers = [], [], [], [], []
    listed = list(getattr(config, family.kinds_field, None) or ()) if family.kinds_field else []
    for i, layer in enumerate(layers):
        where = f"layers[{i}]."
        kind = _get(layer, family.layer_kind) if family.layer_kind else listed[i] if i < len(listed) else None

        def at(path: str, part: str, layer: nn.Module = layer, kind: object = kind) -> nn.Module | None:
            found = _get(layer, path) if path is not None else None
            return found if isinstance(found, nn.Module) and (path not in shared or kinds.get(kind) == part) else None

        if kinds and kind not in kinds:
            at_kind = family.layer_kind or f"config.{family.kinds_field}[{i}]"  # where the kind was read
            missing.append(f"{where}{at_kind} of a known kind ({', '.join(kinds)}; it is {kind!r})")
            continue
        if family.mixers:
            found = [m for m in (at(path, "mixer") for path in family.mixers) if m is not None]
            attention.append(at(family.attention, "attention"))
            mixers += found
            mlp = at(family.mlp, "mlp")
            mlps += [mlp] if mlp is not None else []
            if attention[-1] is None and not found and mlp is None:
                missing.append(f"{where}{' or '.join((family.attention, *family.mixers))}")
            # a hybrid's attention and mixer layers may name their norms differently (Olmo-Hybrid)
            norms += [m for m in (_get(layer, path) for path in family.layer_norms) if isinstance(m, nn.Module)]
        else:
            attention.append(_part(layer, family.attention, nn.Module, where, missing))
            mlps += [_part(layer, family.mlp, nn.Module, where, missing)] if family.mlp is not None else []
            norms += [_part(layer, path, nn.Module, where, missing) for path in family.layer_norms]
        per_token += [m for m in (_get(layer, path) for path in family.per_token) if isinstance(m, nn.Module)]
    return dict(
        attention=tuple(attention),
        mlps=tuple(mlps),
        per_token=tuple(per_token),
        layer_norms=tuple(norms),
        mixers=tuple(mixers),
    )


def find_anatomy(model: object) -> ModelAnatomy | str:
    """The anatomy of ``model``, or the reason it cannot be found (a sentence; callers raise it, or report it).

    Args:
        model: a transformers model of a registered family: with a head (``...ForCausalLM``) or a bare
            decoder; a PEFT wrapper is looked through (``get_base_model()``).

    Returns:
        The ``ModelAnatomy``, or a sentence naming the unknown family or the missing parts.
    """
    from torch import nn

    family = family_of(model)
    if isinstance(family, str):
        return family
    if not isinstance(model, nn.Module):
        return f"{type(model).__name__} is not a torch.nn.Module"
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    outer = _get(base, family.decoder)
    head = _get(base, family.head)
    if not isinstance(outer, nn.Module):  # a bare decoder (LlamaModel): no head
        outer, head = base, None
    missing: list[str] = []
    decoder = _part(outer, family.text_model, nn.Module, "", missing) if family.text_model else outer
    layers = _part(decoder, family.layers, nn.ModuleList, "", missing) if decoder is not None else None
    if layers is None:
        return _missing(model, family, missing)
    parts = dict(
        embedding=_part(decoder, family.embedding, nn.Module, "", missing),
        norm=_part(decoder, family.norm, nn.Module, "", missing),
        rotary=_part(decoder, family.rotary, nn.Module, "", missing),
        **_layer_parts(family, layers, missing, getattr(decoder, "config", None)),
    )
    if missing:
        return _missing(model, family, missing)
    names = {id(m): n for n, m in model.named_modules()}
    head = head if isinstance(head, nn.Module) and id(head) in names else None
    return ModelAnatomy(family=family, decoder=decoder, layers=layers, head=head, names=names, **parts)


def _missing(model: nn.Module, family: Family, missing: list[str]) -> str:
    shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
    return (
        f"{type(model).__name__} lacks {shown} where the {family.model_type!r} family entry puts them "
        "(seqpar.models.FAMILIES; register_family(..., replace=True) corrects an entry)"
    )


def anatomy(model: object) -> ModelAnatomy:
    """The anatomy of ``model`` (Note [model families]).

    Args:
        model: a transformers model of a registered family (``seqpar.models.FAMILIES``), or one whose anatomy
            can be read from the model (Note [read anatomy]).

    Returns:
        Its ``ModelAnatomy``.

    Raises:
        SeqparInputError: a family whose parts cannot be read (describe it with ``register_family``) or a model
            that lacks a part where its family entry puts it.
    """
    found = find_anatomy(model)
    if isinstance(found, str):
        raise SeqparInputError(f"cannot find the parts of this model: {found}")
    return found
