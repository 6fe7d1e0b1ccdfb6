"""Qwen4-Exp's text decoder under sequence parallelism, judged as the zoo judges a family (loss, logits, every gradient
vs one process, within its float64 floor): gated DeltaNet, QSA, per-layer n-gram embeddings, hyper-connections.

At 2 and 3 ranks on whole rows and on a packed row (against each document alone), end-of-text ids inside the rows.
With the n-gram embedding's token-id halo switched off (Note [n-gram halo]) it comes out WRONG, and its embeddings
differ from one process's exactly at the first ``n - 1`` tokens of each chunk after the row's first; with the halo
kept across document starts, a packed row comes out WRONG.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

from benchmarks import zoo
from benchmarks.zoo import EXACT, WRONG
from seqpar.sequence_parallel.mixers import ngram
from tests._dist import run_ranks, shard_index

TEXT = "qwen4_exp_text"
EOS_AT = (5, 13)
"""End-of-text ids inside each row: one just before a chunk's edge at 2 ranks (6), whose halo then holds it."""


def _model() -> torch.nn.Module:
    """The zoo's tiny Qwen4-Exp (a gated DeltaNet layer with the n-gram embeddings, a QSA layer keeping 8 tokens in
    blocks of 4), its experts in transformers' eager loop (the grouped matmul takes no float64)."""
    import transformers

    from seqpar.models.zoo import tiny_config

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(TEXT), attn_implementation="sdpa").eval()
    model.set_experts_implementation("eager")
    for layer in model.model.layers:
        if hasattr(layer, "linear_attn"):  # weak decay, as tests/test_mixers.py's: the state a chunk hands on matters
            layer.linear_attn.A_log.data.fill_(math.log(0.02))
        if layer.ple is not None:  # built zero, so its convolution's halo would not reach the outputs
            torch.nn.init.normal_(layer.ple.conv1d.weight, std=0.3, generator=torch.Generator().manual_seed(2))
    return model


def _ids(world: int, packed: bool) -> tuple[torch.Tensor, tuple[int, ...] | None]:
    seq = zoo._seq_len(world)
    ids = torch.randint(4, 96, (1 if packed else zoo.ROWS, seq), generator=torch.Generator().manual_seed(1))
    ids[:, list(EOS_AT)] = _model_eos()
    return ids, zoo._documents(seq) if packed else None


def _model_eos() -> int:
    from seqpar.models.zoo import tiny_config

    return tiny_config(TEXT).eos_token_id


def _judged(rank: int, world: int, packed: bool) -> dict:
    """One run at ``world`` ranks against one process (and its float64 copy) on two whole rows or one packed row."""
    ids, documents = _ids(world, packed)
    batch = {"input_ids": ids}
    if documents is not None:
        batch["position_ids"] = torch.cat([torch.arange(n) for n in documents])[None]
    pristine, want, exact = zoo.split_references(rank, world, _model(), lambda m: zoo._reference(m, ids, documents))

    def on_shards(parallel: torch.nn.Module, shard: dict) -> torch.Tensor:
        return parallel(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits

    return zoo.judged_run(pristine, rank, world, batch, on_shards, want, exact, False)


def _quiet() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.simplefilter("ignore")


def _exact_on_rank(rank: int, world: int) -> None:
    _quiet()
    found = {packed: _judged(rank, world, packed) for packed in (False, True)}
    assert {k: v["status"] for k, v in found.items()} == dict.fromkeys(found, EXACT), found


@pytest.mark.parametrize("world", [2, 3])
def test_qwen4_exp_is_exact_on_rows_and_a_packed_row(world):
    """The n-gram ids and the dilated convolution across chunk edges and kept inside documents, the delta rule's
    state passed, each QSA query ranking the blocks of its whole row."""
    run_ranks(world, _exact_on_rank)


def _embeddings(rank: int, world: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first PLE layer's n-gram embeddings of this rank's tokens under seqpar, and one process's."""
    import seqpar
    from seqpar.mesh import as_sp_mesh
    from seqpar.sequence_parallel.call_context import CallContext
    from seqpar.sequence_parallel.masks.sequence_mask import sequence_mask

    embedding = next(layer.ple for layer in _model().model.layers if layer.ple is not None).ple_embedding
    mesh = seqpar.make_mesh(sp_size=world)
    shard = seqpar.shard_batch({"input_ids": ids}, mesh)
    sp = as_sp_mesh(mesh)
    mask = sequence_mask(shard["position_ids"], sp, layout="zigzag", batch_size=ids.shape[0])
    ctx = CallContext(sp, "auto", "zigzag", "auto", mask, {})
    with torch.no_grad():
        return ngram.ngram_embeddings(embedding, shard["input_ids"], ctx), embedding(ids, None)


def _control_on_rank(rank: int, world: int) -> None:
    _quiet()
    ids, _ = _ids(world, False)
    idx = shard_index("zigzag", world, rank, ids.shape[1])
    got, want = _embeddings(rank, world, ids)
    assert torch.equal(got, want[:, idx])
    kept, kept_starts = ngram.chunk_halos, ngram.document_starts
    found = {}
    try:  # the ids before each chunk taken as the pad id 0: the shard's own ids alone
        ngram.chunk_halos = lambda pieces, halo, sp, layout: pieces.new_zeros(*pieces.shape[:-1], halo)
        found["no halo"] = _judged(rank, world, False)
        got, _ = _embeddings(rank, world, ids)
        ngram.chunk_halos = kept
        ngram.document_starts = lambda sp, layout, mask, local: kept_starts(sp, layout, None, local)
        found["no document starts"] = _judged(rank, world, True)  # a document's first ids hash the one before
    finally:
        ngram.chunk_halos, ngram.document_starts = kept, kept_starts
    assert {k: v["status"] for k, v in found.items()} == dict.fromkeys(found, WRONG), found
    context = _model().model.layers[0].ple.ple_embedding.context_len
    differs = (got != want[:, idx]).any(-1).any(0)  # [local tokens]
    size = ids.shape[1] // (2 * world)
    first = (idx % size < context) & (idx >= size)  # a chunk's first n - 1 tokens, the row's own first chunk aside
    assert torch.equal(differs, first), (differs, first)


def test_qwen4_exp_without_the_ngram_halo_or_its_document_starts_is_wrong():
    run_ranks(2, _control_on_rank)


def test_qwen4_exp_multimodal_text_path_reads_the_text_entry():
    """``qwen4_exp``'s text decoder keeps ``qwen4_exp_text``'s entry, so its mixers are served by the same adapters."""
    import transformers

    from seqpar.models import anatomy
    from seqpar.models.zoo import tiny_config

    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(tiny_config("qwen4_exp"))
    found = anatomy(model)
    kinds = {type(m).__name__ for m in found.mixers}
    assert kinds == {"Qwen4ExpTextGatedDeltaNet", "Qwen4ExpTextPLELayer"}, kinds
    assert not found.undeclared()
    assert copy.copy(found.family.per_token) == ("attn_hyper_connection", "mlp_hyper_connection")
