"""Attention adapters (Note [attention adapters]): families whose attention computes its softmax in its own code.

GPT-Neo, OpenAI GPT, XGLM, TrOCR (its learned position table given the global position ids) and GPT-NeoX-Japanese
at 2 and 3 ranks equal one process on loss, logits and every gradient (the zoo's judgement: RTOL of the float64
scale, or the fp32 run's own distance from float64), with packed documents, GPT-Neo's local window biting, and
ring, Ulysses and all-gather asked for by name. Negative controls: a class without its adapter row, or lacking
what the row reads, is refused by name; an adapter that skips seqpar's attention is caught at run time naming the
module; encoder states reaching a cross-attention are refused; a learned relative position bias and a position
table no adapter serves (TrOCR's sinusoidal one) are refused by name (ALiBi, served for BLOOM and MPT: test_alibi).
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from dataclasses import dataclass

import pytest
import torch

import seqpar
from benchmarks.zoo import judge, module_floors
from seqpar.errors import SeqparInputError
from seqpar.models.zoo import CAUSAL_LM, TEXT_IDS, tiny_config, tiny_model
from seqpar.sequence_parallel import attention_adapters
from seqpar.sequence_parallel.prepare import last_attention_choice, unserved_reason
from tests._dist import run_ranks, shard_index

SEQ = 24
DOCUMENTS = (10, 14)  # a document edge inside a shard at 2 and 3 ranks


@dataclass(frozen=True)
class Case:
    """One family run under seqpar and judged against one process."""

    model_type: str
    strategy: str = "auto"
    packed: bool = False
    window: int | None = None  # GPT-Neo's window_size, small enough to bite in SEQ tokens


def _model(case: Case) -> torch.nn.Module:
    if case.window is None:
        return tiny_model(case.model_type, (CAUSAL_LM,))
    import transformers

    config = tiny_config(case.model_type)
    config.window_size = case.window
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def _one_process(model: torch.nn.Module, ids: torch.Tensor, documents: tuple[int, ...] | None) -> tuple:
    """Logits, token-mean next-token loss and gradients of the whole batch, each document run by itself."""
    model.zero_grad(set_to_none=True)
    lengths = documents or (ids.shape[1],)
    logits, total = [], 0.0
    for start, n in zip([sum(lengths[:i]) for i in range(len(lengths))], lengths, strict=True):
        doc = ids[:, start : start + n]
        out = model(input_ids=doc, position_ids=torch.arange(n)[None].expand_as(doc)).logits
        total = total + torch.nn.functional.cross_entropy(
            out[:, :-1].flatten(0, 1).float(), doc[:, 1:].flatten(), reduction="sum"
        )
        logits.append(out.detach())
    loss = total / sum(ids.shape[0] * (n - 1) for n in lengths)
    loss.backward()
    return (
        torch.cat(logits, 1),
        loss.detach(),
        {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
    )


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # a float64 process: XGLM fills its mask at the default dtype
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _worst(rank: int, world: int, case: Case) -> tuple[float, str]:
    """(distance over bound, description) of the worst tensor of ``case`` on this rank."""
    model = _model(case)
    rows = 1 if case.packed else 2
    ids = torch.randint(*TEXT_IDS, (rows, SEQ), generator=torch.Generator().manual_seed(1))
    documents = DOCUMENTS if case.packed else None
    batch = {"input_ids": ids}
    if documents is not None:
        batch["position_ids"] = torch.cat([torch.arange(n) for n in documents])[None]
    pristine = copy.deepcopy(model)
    want_logits, want_loss, want_grads = _one_process(model, ids, documents)
    with _default_dtype(torch.float64):
        exact_logits, exact_loss, exact_grads = _one_process(copy.deepcopy(pristine).double(), ids, documents)

    mesh = seqpar.make_mesh(sp_size=world)
    parallel = seqpar.prepare_model(pristine, mesh, strategy=case.strategy)
    shard = seqpar.shard_batch(batch, mesh)
    logits = parallel(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
    loss = seqpar.cross_entropy(logits.float(), shard["shift_labels"], mesh)
    loss.backward()
    seqpar.reduce_gradients(parallel.parameters(), mesh)
    if case.strategy != "auto":
        assert last_attention_choice(parallel).strategy == case.strategy
    idx = shard_index("zigzag", world, rank, SEQ)
    judged = [
        judge("loss", seqpar.sum_over(loss.detach(), mesh), want_loss, exact_loss),
        judge("logits", logits, want_logits[:, idx], exact_logits[:, idx]),
    ]
    floors = module_floors(want_grads, exact_grads)
    for name, p in parallel.named_parameters():  # an unused cross-attention has no gradient in either run
        if p.grad is not None or name in want_grads:
            zero = torch.zeros_like(p)
            got, want = (zero if g is None else g for g in (p.grad, want_grads.get(name)))
            module = floors.get(name.rpartition(".")[0], (0.0, 0.0))
            judged.append(judge(f"grad {name}", got, want, exact_grads.get(name, zero), module))
    return max(judged, key=lambda j: j[0])


def _cases_on_rank(rank: int, world: int, cases: tuple[Case, ...]) -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        worst = [(case, _worst(rank, world, case)) for case in cases]  # every rank runs every case, then judges
    wrong = [f"{case}: {said}" for case, (ratio, said) in worst if ratio > 1.0]
    assert not wrong, "\n".join(wrong)


SERVED = ("gpt_neo", "openai-gpt", "xglm", "trocr", "gpt_neox_japanese")
CASES = {
    2: (
        *(Case(t) for t in SERVED),
        *(Case(t, packed=True) for t in SERVED),
        Case("gpt_neo", "ring", packed=True, window=4),
        Case("gpt_neo", "ulysses", window=4),
        Case("gpt_neox_japanese", "ring"),
        Case("trocr", "ulysses", packed=True),
    ),
    3: (*(Case(t) for t in SERVED), Case("gpt_neo", "allgather", packed=True, window=4)),
}


@pytest.mark.parametrize("sp", sorted(CASES))
def test_served_families_equal_one_process(sp):
    run_ranks(sp, _cases_on_rank, CASES[sp])


def _built(model_type: str, **changes: object) -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    config = tiny_config(model_type)
    for key, value in changes.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


@pytest.mark.parametrize(
    "model_type, words",
    [
        ("cpmant", "learned relative position bias"),
        ("trocr", "TrOCRSinusoidalPositionalEmbedding) numbers each call's tokens from 0"),
    ],
)
def test_position_biases_and_own_positions_are_refused_by_name(model_type, words):
    sinusoidal = {"use_learned_position_embeddings": False} if model_type == "trocr" else {}  # no adapter row
    reason = unserved_reason(_built(model_type, **sinusoidal))
    assert reason is not None and words in reason, reason


def test_a_class_without_its_adapter_row_is_refused_by_name(monkeypatch):
    model = _built("xglm")
    assert unserved_reason(model) is None
    monkeypatch.delitem(attention_adapters.ADAPTERS, "XGLMAttention")
    reason = unserved_reason(model)
    assert "XGLMAttention computes its attention in its own code and seqpar has no adapter" in reason, reason


def test_a_position_table_without_its_adapter_row_is_refused_by_name(monkeypatch):
    model = _built("trocr")
    assert unserved_reason(model) is None
    monkeypatch.delitem(attention_adapters.POSITION_ADAPTERS, "TrOCRLearnedPositionalEmbedding")
    reason = unserved_reason(model)
    assert "TrOCRLearnedPositionalEmbedding counts its tokens' positions in its own code" in reason, reason


def test_a_module_lacking_what_its_adapter_reads_is_refused_by_name():
    model = _built("gpt_neox_japanese")
    del model.gpt_neox_japanese.layers[1].attention.rotary_ndims  # as another transformers version may build it
    reason = unserved_reason(model)
    assert "GPTNeoXJapaneseAttention lacks rotary_ndims" in reason, reason


def _ids() -> dict:
    ids = torch.randint(*TEXT_IDS, (1, 8), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "position_ids": torch.arange(8)[None]}


def test_an_adapter_that_skips_seqpar_attention_is_caught_naming_the_module(monkeypatch):
    def local_only(self, x, attention_mask=None, output_attentions=False, **kwargs):
        return [self.c_proj(x)]  # mixes no tokens across ranks, and never calls seqpar's attention

    row = attention_adapters.ADAPTERS["Attention"]
    monkeypatch.setitem(
        attention_adapters.ADAPTERS, "Attention", attention_adapters.AttentionAdapter(local_only, row.reads)
    )
    model = seqpar.prepare_model(_built("openai-gpt"), None)
    with pytest.raises(SeqparInputError, match=r"transformer\.h\.0\.attn \(SeqparAttention\) ran without calling"):
        model(**_ids())


@pytest.mark.parametrize("model_type, changes", [("xglm", {"add_cross_attention": True}), ("trocr", {})])
def test_encoder_states_reaching_cross_attention_are_refused(model_type, changes):
    model = seqpar.prepare_model(_built(model_type, **changes), None)
    model(**_ids())  # the decoder alone runs; its cross-attention is unused
    states = torch.zeros(1, 5, model.config.hidden_size)
    with pytest.raises(SeqparInputError, match="Attention was handed encoder states"):
        model(**_ids(), encoder_hidden_states=states)


def test_unsharded_the_class_runs_its_own_forward():
    from seqpar.integrations.unsharded import unsharded

    own = _built("gpt_neo")
    model = seqpar.prepare_model(copy.deepcopy(own), None)
    assert type(model.transformer.h[0].attn).__name__ == "SeqparGPTNeoAttention"
    assert set(model.state_dict()) == set(own.state_dict())  # the swap keeps the parameters and their names
    with torch.no_grad(), unsharded(model):
        got = model(input_ids=_ids()["input_ids"]).logits
    torch.testing.assert_close(got, own(input_ids=_ids()["input_ids"]).logits, rtol=0, atol=0)
