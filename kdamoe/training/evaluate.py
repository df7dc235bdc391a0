"""Validation metrics: perplexity and bits per byte of a causal LM, and a count-based bigram baseline.

Both score exactly the same targets: in packed rows (see :func:`kdamoe.training.data.pack_documents`)
token ``t+1`` is predicted from the prefix up to ``t`` wherever ``labels[t+1] != -100``. Bits per
byte divides the summed negative log-likelihood (in bits) by the UTF-8 bytes of those targets, so
it compares across tokenizers; special tokens count zero bytes.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

from .data import IGNORE_INDEX


def _metrics(nll_nats: float, n_tokens: int, n_bytes: int) -> dict[str, float]:
    loss = nll_nats / max(n_tokens, 1)
    return {
        "loss": loss,
        "ppl": math.exp(loss),
        "bpb": nll_nats / math.log(2) / max(n_bytes, 1),
        "tokens": n_tokens,
        "bytes": n_bytes,
    }


def _targets(rows: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Previous token, target token and validity mask, each ``[N, T-1]``."""
    prev, target = rows["input_ids"][:, :-1], rows["labels"][:, 1:]
    return prev, target, target != IGNORE_INDEX


@torch.no_grad()
def evaluate_lm(model, rows: dict[str, torch.Tensor], byte_lengths: list[int], batch_size: int = 8,
                device: torch.device | str = "cpu", autocast_dtype: torch.dtype | None = None) -> dict[str, float]:
    """Score ``model`` on packed rows.

    Args:
        model: a causal LM called as ``model(input_ids=[B,T], position_ids=[B,T])`` returning ``.logits [B,T,V]``.
        rows: ``input_ids``, ``position_ids``, ``labels`` ``[N, T]`` int64.
        byte_lengths: UTF-8 bytes per token id (:func:`kdamoe.training.tokenizer.token_byte_lengths`).
        batch_size: rows per forward.
        device: where to run.
        autocast_dtype: e.g. ``torch.bfloat16`` to run under autocast; ``None`` runs in the model's dtype.
    Returns:
        ``{"loss": mean nats/token, "ppl": exp(loss), "bpb": bits/byte, "tokens": n, "bytes": n}``.
    """
    was_training = model.training
    model.eval()
    device = torch.device(device)
    lengths = torch.tensor(byte_lengths, dtype=torch.long)
    nll, n_tok, n_bytes = 0.0, 0, 0
    amp = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None
           else contextlib.nullcontext())
    for i in range(0, rows["input_ids"].shape[0], batch_size):
        batch = {k: v[i:i + batch_size] for k, v in rows.items()}
        with amp:
            logits = model(input_ids=batch["input_ids"].to(device), position_ids=batch["position_ids"].to(device),
                           use_cache=False).logits
        _, target, valid = _targets(batch)
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).cpu()
        picked = logp.gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
        nll -= picked[valid].double().sum().item()
        n_tok += int(valid.sum())
        n_bytes += int(lengths[target[valid]].sum())
    model.train(was_training)
    return _metrics(nll, n_tok, n_bytes)


class BigramBaseline:
    """Token bigram model with interpolated absolute discounting, fitted by counting.

    ``P(b | a) = max(c(a,b) − d, 0) / c(a) + d · n(a) / c(a) · P₁(b)`` where ``c(a,b)`` counts the
    pair, ``c(a) = Σ_b c(a,b)``, ``n(a)`` is the number of distinct successors of ``a`` and
    ``P₁(b) = (c(b) + 1) / (Σ c + V)`` the add-one unigram over targets; an unseen context falls
    back to ``P₁``. Counts are kept sparse, so any vocabulary size works.
    """

    def __init__(self, vocab_size: int, discount: float = 0.75):
        if not 0.0 < discount < 1.0:
            raise ValueError(f"discount must lie in (0, 1), got {discount}")
        self.vocab_size, self.discount = vocab_size, discount

    def fit(self, docs: list[list[int]]) -> "BigramBaseline":
        """Count consecutive pairs inside each token document (never across two documents)."""
        prev = np.concatenate([np.asarray(d[:-1], dtype=np.int64) for d in docs if len(d) > 1])
        nxt = np.concatenate([np.asarray(d[1:], dtype=np.int64) for d in docs if len(d) > 1])
        v = self.vocab_size
        self.pair_keys, self.pair_counts = np.unique(prev * v + nxt, return_counts=True)
        self.context_counts = np.bincount(prev, minlength=v)
        self.successors = np.bincount(self.pair_keys // v, minlength=v)
        unigram = np.bincount(nxt, minlength=v).astype(np.float64)
        self.unigram = (unigram + 1.0) / (unigram.sum() + v)
        return self

    def prob(self, prev: np.ndarray, nxt: np.ndarray) -> np.ndarray:
        """``P(nxt | prev)`` element-wise for int arrays of equal shape (float64)."""
        prev, nxt = np.asarray(prev, dtype=np.int64), np.asarray(nxt, dtype=np.int64)
        keys = prev * self.vocab_size + nxt
        idx = np.clip(np.searchsorted(self.pair_keys, keys), 0, len(self.pair_keys) - 1)
        pair = np.where(self.pair_keys[idx] == keys, self.pair_counts[idx], 0).astype(np.float64)
        ctx = self.context_counts[prev].astype(np.float64)
        p_uni = self.unigram[nxt]
        safe = np.maximum(ctx, 1.0)
        p = np.maximum(pair - self.discount, 0.0) / safe + self.discount * self.successors[prev] / safe * p_uni
        return np.where(ctx > 0, p, p_uni)

    def evaluate(self, rows: dict[str, torch.Tensor], byte_lengths: list[int]) -> dict[str, float]:
        """Score the same targets as :func:`evaluate_lm`; returns the same keys."""
        prev, target, valid = _targets(rows)
        p = self.prob(prev[valid].numpy(), target[valid].numpy())
        n_bytes = int(torch.tensor(byte_lengths, dtype=torch.long)[target[valid]].sum())
        return _metrics(float(-np.log(p).sum()), int(valid.sum()), n_bytes)
