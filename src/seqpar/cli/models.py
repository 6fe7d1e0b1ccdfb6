"""``seqpar models``: which families of the installed transformers seqpar serves, and how it knows their parts.

Each family's tiny model is built on the meta device and checked as ``prepare_model`` checks it; nothing runs.
"""

from __future__ import annotations

import argparse
import json

_STATUSES = ("entry", "read", "refused", "not built", "set aside")


def add_models_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``seqpar models``' flags: ``--only`` and ``--json``.

    Args:
        parser: the subcommand's parser.
    """
    parser.add_argument("--only", default="", help="comma-separated model types (default: every one)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per model type")


def _row(model_type: str, entry: object) -> dict:
    """One model type: its status among ``_STATUSES`` and why."""
    from seqpar.models import find_anatomy
    from seqpar.models.zoo import short_reason, tiny_model
    from seqpar.sequence_parallel.prepare import unserved_reason

    row = {"model_type": model_type, "mappings": list(entry.mappings)}
    if entry.set_aside is not None:
        return row | {"status": "set aside", "why": entry.set_aside}
    model = tiny_model(model_type, entry.mappings, device="meta")
    if isinstance(model, str):
        return row | {"status": "not built", "why": model}
    why = unserved_reason(model)
    if why is not None:
        return row | {"status": "refused", "why": short_reason(why)}
    family = find_anatomy(model).family
    multimodal = getattr(model.config, "vision_config", None) is not None
    images = ("with images" if family.vision else "text only") if multimodal else ""
    return row | {"status": "read" if family.derived else "entry", "images": images, "why": family.images or ""}


def run_models(args: argparse.Namespace) -> int:
    """Print every model type of the installed transformers' causal-LM and image-text-to-text mappings.

    Args:
        args: the parsed flags of ``add_models_flags``.

    Returns:
        0.
    """
    import warnings

    import transformers

    from seqpar.models.zoo import zoo_model_types

    transformers.logging.set_verbosity_error()  # default configs warn of their special ids
    wanted = {m for m in args.only.split(",") if m}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = [_row(model_type, entry) for model_type, entry in zoo_model_types(wanted or None).items()]
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    for row in rows:
        print(f"{row['model_type']:30s} {row['status']:10s} {row.get('images', ''):12s} {row['why'][:200]}")
    counts = ", ".join(f"{sum(r['status'] == s for r in rows)} {s}" for s in _STATUSES)
    print(
        f"\n{len(rows)} model types of transformers {transformers.__version__}: {counts}. 'entry': seqpar's "
        "registry describes the family; 'read': its anatomy is read from the model (Note [read anatomy]); 'with "
        "images': calls with pixels are served on whole rows (Note [whole-row calls]). Whether each served family "
        "equals one process is measured by the zoo sweeps: docs/models.md."
    )
    return 0
