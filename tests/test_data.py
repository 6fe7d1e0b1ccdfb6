"""shard_batch, pack_documents and the losses on one process: labels, padding, documents, chunked logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import seqpar
from seqpar import IGNORE_INDEX
from seqpar.errors import SeqparInputError


def test_labels_shift_before_sharding_and_stop_at_document_ends():
    ids = torch.arange(10, 22)[None]  # 12 tokens
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]])
    full = seqpar.shard_batch({"input_ids": ids, "position_ids": positions}, None)
    want = torch.tensor([[11, 12, 13, IGNORE_INDEX, 15, 16, IGNORE_INDEX, 18, 19, 20, 21, IGNORE_INDEX]])
    assert torch.equal(full["shift_labels"], want)
    assert torch.equal(full["position_ids"], positions)
    # explicit labels are shifted the same way; ignored labels stay ignored
    labels = ids.clone()
    labels[0, 2] = IGNORE_INDEX
    got = seqpar.shard_batch({"input_ids": ids, "labels": labels}, None)["shift_labels"]
    assert got[0, 1] == IGNORE_INDEX and got[0, 0] == 11 and got[0, -1] == IGNORE_INDEX
    # shift_labels are taken as they are
    assert torch.equal(seqpar.shard_batch({"input_ids": ids, "shift_labels": want}, None)["shift_labels"], want)


def test_right_padding_and_layout_padding():
    ids = torch.arange(1, 8)[None]  # 7 tokens; the last two are padding
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0]])
    shard = seqpar.shard_batch({"input_ids": ids, "attention_mask": mask}, None, layout="zigzag")
    assert shard["input_ids"].shape == (1, 8)  # padded to a multiple of 2 chunks
    assert shard["shift_labels"].tolist() == [[2, 3, 4, 5, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]]
    assert shard["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 6, 0]]  # layout padding is its own document
    # the tokens a router loss counts: the batch's own (the last real one included), not either padding
    assert shard["token_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0, 0]]
    assert seqpar.shard_batch({"input_ids": ids}, None)["token_mask"].tolist() == [[1] * 7 + [0]]
    with pytest.raises(SeqparInputError, match="only right padding"):
        seqpar.shard_batch({"input_ids": ids, "attention_mask": mask.flip(1)}, None)
    with pytest.raises(SeqparInputError, match="labels look shifted already"):
        seqpar.shard_batch({"input_ids": ids, "labels": torch.roll(ids, -1, 1)}, None)
    with pytest.raises(SeqparInputError, match="must match input_ids"):
        seqpar.shard_batch({"input_ids": ids, "labels": ids[:, :3]}, None)
    with pytest.raises(SeqparInputError, match="row 0 goes 1 -> 3 at global token 2"):
        seqpar.shard_batch({"input_ids": ids, "position_ids": torch.tensor([[0, 1, 3, 4, 0, 1, 2]])}, None)
    with pytest.raises(SeqparInputError, match="needs 'input_ids'"):
        seqpar.shard_batch({"labels": ids}, None)


def test_pack_documents_restarts_positions_and_splits_long_documents():
    rows = seqpar.pack_documents([[1, 2, 3], [4, 5, 6, 7, 8], [9]], seq_len=4)
    assert [r["input_ids"].tolist() for r in rows] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 0, 0, 0]]
    assert [r["position_ids"].tolist() for r in rows] == [[0, 1, 2, 0], [0, 1, 2, 3], [0, 0, 1, 2]]
    assert rows[-1]["attention_mask"].tolist() == [1, 0, 0, 0]
    assert len(seqpar.pack_documents([[1, 2, 3], [4, 5, 6, 7, 8], [9]], seq_len=4, drop_last=True)) == 2


def test_chunked_lm_head_loss_equals_full_logits_loss():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50)
    hidden = torch.randn(2, 24, 16, requires_grad=True)
    labels = torch.randint(0, 50, (2, 24))
    labels[0, :5] = IGNORE_INDEX
    # reference: PyTorch's mean cross-entropy over the valid tokens, on the whole logits
    full = F.cross_entropy(head(hidden).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(seqpar.cross_entropy(head(hidden), labels), full, atol=1e-6, rtol=1e-6)
    full.backward()
    grads = [hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()]
    hidden.grad = head.weight.grad = head.bias.grad = None
    chunked = seqpar.lm_head_cross_entropy(hidden, head, labels, chunk_size=7)
    chunked.backward()
    torch.testing.assert_close(chunked, full, atol=1e-6, rtol=1e-6)
    for got, want in zip((hidden.grad, head.weight.grad, head.bias.grad), grads):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    # under bf16 autocast: the matmuls in bf16 as autocast makes them, the softmax in float32
    hidden.grad = head.weight.grad = head.bias.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full = F.cross_entropy(head(hidden).flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)
    full.backward()
    grads = [hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()]
    hidden.grad = head.weight.grad = head.bias.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chunked = seqpar.lm_head_cross_entropy(hidden, head, labels, chunk_size=7)
    chunked.backward()
    torch.testing.assert_close(chunked, full, atol=1e-5, rtol=1e-5)  # same bf16 logits, float32 sums
    for got, want in zip((hidden.grad, head.weight.grad, head.bias.grad), grads):
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2**-7)  # bf16 matmuls, rounded in other places
    # its backward is not differentiable again: an error, not a wrong second derivative
    (grad,) = torch.autograd.grad(
        seqpar.lm_head_cross_entropy(hidden, head, labels, chunk_size=7), hidden, create_graph=True
    )
    with pytest.raises(RuntimeError, match="does not require grad"):
        grad.sum().backward()
    with pytest.raises(SeqparInputError, match="chunk_size must be a positive"):
        seqpar.lm_head_cross_entropy(hidden, head, labels, chunk_size=0)
    # no valid token: zero, not NaN
    assert seqpar.cross_entropy(torch.randn(1, 3, 50), torch.full((1, 3), IGNORE_INDEX)).item() == 0.0
