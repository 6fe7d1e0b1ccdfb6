"""The rows of tests/hf_scripts/accelerate_guides.py and their one-process references (no seqpar imported)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from transformers import DataCollatorWithFlattening

from tests.hf_scripts.common import documents, save
from tests.hf_scripts.common import model as tiny_model

# name: (world, sp or cp, dp or comm strategy)
GUIDES = {
    "guide_sp_dp1": (2, "sp", 1),
    "guide_sp_dp2": (4, "sp", 2),
    "guide_cp_allgather": (2, "cp", "allgather"),
    "guide_cp_alltoall": (2, "cp", "alltoall"),
}
EPOCHS, LR, CP_WIDTH = 2, 0.1, 24


class RecordingSGD(torch.optim.SGD):
    """SGD that records the gradient norm at every step (the guides log no norm themselves)."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, lr=lr)
        self.norms: list[float] = []

    def step(self, closure=None):
        grads = [p.grad.detach().double() for g in self.param_groups for p in g["params"] if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
        return super().step(closure)


def sp_rows() -> list[dict]:
    """11 documents with labels; rows 4 and 5 keep only row 5's last 3 labels (an SFT prompt masked out): packed,
    the middle half of that batch has no valid token, so one SP rank's shard is empty (zigzag over 2 ranks)."""
    rows = [{"input_ids": d["input_ids"], "labels": list(d["input_ids"])} for d in documents(11, 7)]
    prompt, answer = documents(2, 9, low=30, high=31)[0]["input_ids"], documents(1, 10, low=10, high=11)[0]
    rows[4] = {"input_ids": prompt, "labels": [-100] * 30}
    rows[5] = {"input_ids": answer["input_ids"], "labels": [-100] * 7 + answer["input_ids"][7:]}
    return rows


def cp_rows() -> list[dict]:
    """nd_parallel's dataset: documents concatenated, cut into rows of CP_WIDTH + 1, shifted; some labels masked."""
    tokens = [t for d in documents(40, 11) for t in d["input_ids"]]
    rows = []
    for i in range(6):
        chunk = tokens[i * (CP_WIDTH + 1) : (i + 1) * (CP_WIDTH + 1)]
        rows.append({"input_ids": chunk[:-1], "shift_labels": [t if t >= 40 else -100 for t in chunk[1:]]})
    return rows


def create_collate_fn():  # accelerate's examples/torch_native_parallelism/utils.py
    """Create a collate function for batching."""

    def collate_fn(batch):
        input_ids = torch.tensor([item["input_ids"] for item in batch], dtype=torch.long)
        shift_labels = torch.tensor([item["shift_labels"] for item in batch], dtype=torch.long)
        return {"input_ids": input_ids, "shift_labels": shift_labels, "labels": shift_labels}

    return collate_fn


def packed_collate(features: list[dict]) -> dict:
    """Pairs of documents packed per row (position ids restarting), right-padded to a multiple of 4, shifted."""
    rows = [features[i : i + 2] for i in range(0, len(features), 2)]
    width = -(-max(sum(len(f["input_ids"]) for f in pair) for pair in rows) // 4) * 4
    ids, pos, mask = (torch.zeros(len(rows), width, dtype=torch.long) for _ in range(3))
    shift = torch.full_like(ids, -100)
    for r, pair in enumerate(rows):
        at = 0
        for f in pair:
            n = len(f["input_ids"])
            ids[r, at : at + n] = torch.tensor(f["input_ids"])
            pos[r, at : at + n] = torch.arange(n)
            shift[r, at : at + n - 1] = torch.tensor(f["input_ids"][1:])
            at += n
        mask[r, :at] = 1
        pos[r, at:] = torch.arange(width - at)  # the padding is a document of its own
    return {"input_ids": ids, "position_ids": pos, "attention_mask": mask, "shift_labels": shift, "labels": shift}


def _whole_loss(net, batch: dict) -> torch.Tensor:
    """One process: the token mean of whole rows (transformers' loss from labels, or from shift_labels)."""
    ids, positions = batch["input_ids"], batch.get("position_ids")
    if positions is None:
        positions = torch.arange(ids.shape[1]).expand_as(ids)
    if "shift_labels" not in batch:
        return net(input_ids=ids, position_ids=positions, labels=batch["labels"], use_cache=False).loss
    logits = net(input_ids=ids, position_ids=positions, use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), batch["shift_labels"].flatten(), ignore_index=-100)


def sp_reference(dp: int) -> dict:
    """One process, no SP: each step the mean of the dp replicas' token means (DDP's average over replicas,
    what the guide's loop gives without SP on dp processes); every replica has rows in every step here."""
    net = tiny_model("llama")
    optimizer = RecordingSGD(net.parameters(), lr=LR)
    dl = DataLoader(sp_rows(), batch_size=2, collate_fn=DataCollatorWithFlattening(), shuffle=False)
    losses = []
    for _ in range(EPOCHS):
        batches = list(dl)
        for i in range(0, len(batches), dp):
            optimizer.zero_grad()
            means = [_whole_loss(net, b) for b in batches[i : i + dp]]
            assert len(means) == dp, "a replica without rows: the guide's loop cannot run such a step"
            (sum(means) / dp).backward()
            optimizer.step()
            losses.append(float(means[0].detach()))  # rank 0 logs its replica's loss
    sums = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for b in DataLoader(sp_rows()[:5], batch_size=2, collate_fn=DataCollatorWithFlattening()):
            count = (b["labels"][:, 1:] != -100).sum().double()
            if count > 0:  # transformers' mean of no token is NaN
                sums += torch.stack([_whole_loss(net, b).double() * count, count])
    params = {n: p.detach().clone() for n, p in net.named_parameters()}
    return {"loss": losses, "norm": optimizer.norms, "params": params, "held_out": sums.tolist()}


def cp_reference(comm: str) -> dict:
    """One process: nd_parallel's step on whole rows, or (alltoall) micro-batch means / 2 accumulated 2 by 2."""
    net = tiny_model("llama")
    optimizer = RecordingSGD(net.parameters(), lr=LR)
    packed = comm == "alltoall"
    if packed:
        batches = list(DataLoader(documents(12, 12), batch_size=4, collate_fn=packed_collate))
    else:
        batches = list(DataLoader(cp_rows(), batch_size=1, collate_fn=create_collate_fn()))
    losses = []
    for i, batch in enumerate(batches):
        loss = _whole_loss(net, batch)
        (loss / (2 if packed else 1)).backward()
        losses.append(float(loss.detach()))
        if not packed or i % 2 == 1 or i == len(batches) - 1:
            optimizer.step()
            optimizer.zero_grad()
    params = {n: p.detach().clone() for n, p in net.named_parameters()}
    return {"loss": losses, "norm": optimizer.norms, "params": params}


def reference(out: str, name: str) -> None:
    _, kind, option = GUIDES[name]
    found = sp_reference(option) if kind == "sp" else cp_reference(option)
    save(os.path.join(out, "reference", f"{name}.pt"), found)
