"""Tokenized, packed training data.

Documents become ``bos + text + eos`` token runs, laid end to end in one stream and cut into rows
of ``seq_len`` tokens. Each row carries ``position_ids`` that restart at 0 wherever a document (or
a row) starts, which is how the model is told where one sequence ends and the next begins
(padding-free packing: no attention mask). ``labels`` are ``-100`` at every restart, so after the
model's internal shift no token is ever predicted from another document.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset

IGNORE_INDEX = -100


def tokenize_documents(tokenizer, texts: list[str], bos_id: int, eos_id: int) -> list[list[int]]:
    """Encode each text as ``[bos_id] + tokens + [eos_id]`` (no other special tokens added)."""
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    return [[bos_id, *ids, eos_id] for ids in encoded]


def pack_documents(docs: list[list[int]], seq_len: int, pad_id: int,
                   drop_last: bool = False) -> dict[str, torch.Tensor]:
    """Pack token documents into rows of ``seq_len`` tokens with restarting positions.

    Args:
        docs: token id lists, in packing order (documents longer than a row continue on the next).
        seq_len: row length T (tokens), ≥ 2.
        pad_id: fills the tail of the last row; pad positions form their own sequence, label -100.
        drop_last: drop the incomplete last row instead of padding it.
    Returns:
        ``input_ids``, ``position_ids``, ``labels``: int64 tensors ``[N, T]``. ``position_ids`` is 0
        at every document start and at every row start, then counts up by one; ``labels`` equals
        ``input_ids`` except ``-100`` where ``position_ids == 0`` and on padding.
    Raises:
        ValueError: ``seq_len < 2`` or there are no tokens.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    lengths = torch.tensor([len(d) for d in docs if d], dtype=torch.long)
    if lengths.numel() == 0:
        raise ValueError("no tokens to pack")
    stream = torch.tensor([t for d in docs for t in d], dtype=torch.long)
    n_tok = stream.numel()
    starts = torch.zeros(n_tok, dtype=torch.bool)
    starts[torch.cumsum(lengths, 0)[:-1]] = True
    starts[0] = True
    n_rows = n_tok // seq_len if drop_last else -(-n_tok // seq_len)
    if n_rows == 0:
        raise ValueError(f"fewer than seq_len={seq_len} tokens with drop_last=True")
    total = n_rows * seq_len
    real = torch.ones(total, dtype=torch.bool)
    if total > n_tok:  # pad the tail: one extra "document" of pad tokens
        stream = torch.cat([stream, stream.new_full((total - n_tok,), pad_id)])
        starts = torch.cat([starts, torch.zeros(total - n_tok, dtype=torch.bool)])
        starts[n_tok] = True
        real[n_tok:] = False
    stream, starts, real = stream[:total], starts[:total].clone(), real[:total]
    starts[::seq_len] = True  # a row never continues a sequence from the row before
    idx = torch.arange(total)
    last_start = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), 0).values
    positions = idx - last_start
    labels = torch.where(starts | ~real, torch.full_like(stream, IGNORE_INDEX), stream)
    return {
        "input_ids": stream.view(n_rows, seq_len),
        "position_ids": positions.view(n_rows, seq_len),
        "labels": labels.view(n_rows, seq_len),
    }


class PackedStageDataset(Dataset):
    """The sequence of rows one training stage consumes, in order: ``length`` draws from ``rows``.

    Item ``i`` is row ``perm_e[i mod N]`` with ``e = i // N`` and ``perm_e`` a permutation of the
    N rows seeded by ``(seed, e)``: every epoch visits each row once, in a fresh order, and item
    ``i`` is a pure function of ``i``. Resuming at micro-batch ``m`` therefore only needs to skip
    the first ``m`` batches of a sequential loader — the data position is a number.
    """

    def __init__(self, rows: dict[str, torch.Tensor], length: int, seed: int):
        self.rows, self.length, self.seed = rows, length, seed
        self.n = rows["input_ids"].shape[0]
        self._perms: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.length:
            raise IndexError(i)
        epoch, j = divmod(i, self.n)
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms[epoch] = torch.randperm(self.n, generator=g)
        r = int(self._perms[epoch][j])
        return {k: v[r] for k, v in self.rows.items()}


def stage_loader(rows: dict[str, torch.Tensor], batch_size: int, num_micro_batches: int, seed: int,
                 num_processes: int = 1) -> DataLoader:
    """A sequential ``DataLoader`` yielding exactly ``num_micro_batches`` batches of ``[batch_size, T]`` per process.

    Wrap it with ``accelerator.prepare``: with several processes each one takes its own share of
    every global batch of ``batch_size * num_processes`` rows.
    """
    ds = PackedStageDataset(rows, batch_size * num_micro_batches * num_processes, seed)
    return DataLoader(ds, batch_size=batch_size, shuffle=False, drop_last=True)
