"""Validation metrics: the bigram baseline against hand counts, perplexity/bpb against a known model."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kdamoe.training.data import pack_documents
from kdamoe.training.evaluate import BigramBaseline, evaluate_lm


def test_bigram_matches_hand_computation():
    V, d = 5, 0.5
    docs = [[0, 1, 2, 1, 2], [0, 1, 3]]  # pairs: 01 12 21 12 | 01 13 (never 2→0 across documents)
    bg = BigramBaseline(V, d).fit(docs)
    # unigram over targets: 1:3, 2:2, 3:1 of 6, add-one over V=5 → (c+1)/11
    p_uni = np.array([1, 4, 3, 2, 1]) / 11
    # context 1: c(1)=3, successors {2:2, 3:1} → n(1)=2
    assert bg.prob(np.array([1]), np.array([2]))[0] == pytest.approx((2 - d) / 3 + d * 2 / 3 * p_uni[2])
    assert bg.prob(np.array([1]), np.array([4]))[0] == pytest.approx(d * 2 / 3 * p_uni[4])
    # context 0: c(0)=2, successors {1:2}
    assert bg.prob(np.array([0]), np.array([1]))[0] == pytest.approx((2 - d) / 2 + d * 1 / 2 * p_uni[1])
    # unseen context 4 falls back to the unigram
    assert bg.prob(np.array([4]), np.array([0]))[0] == pytest.approx(p_uni[0])
    assert bg.prob(np.array([2]), np.array([0]))[0] == pytest.approx(d * 1 / 1 * p_uni[0])  # c(2)=1: only 2→1
    # every context's distribution sums to one
    for a in range(V):
        assert bg.prob(np.full(V, a), np.arange(V)).sum() == pytest.approx(1.0)


def test_bigram_evaluate_scores_the_packed_targets():
    V = 6
    docs = [[0, 1, 2, 3], [0, 2, 2, 5]]
    bg = BigramBaseline(V).fit(docs)
    rows = pack_documents(docs, 8, pad_id=4)  # one row: both documents, restart at index 4
    byte_lengths = [0, 1, 2, 3, 0, 5]
    m = bg.evaluate(rows, byte_lengths)
    pairs = [(0, 1), (1, 2), (2, 3), (0, 2), (2, 2), (2, 5)]  # 3→0 across the boundary is not scored
    nll = -sum(math.log(bg.prob(np.array([a]), np.array([b]))[0]) for a, b in pairs)
    assert m["tokens"] == 6 and m["bytes"] == 1 + 2 + 3 + 2 + 2 + 5
    assert m["loss"] == pytest.approx(nll / 6)
    assert m["bpb"] == pytest.approx(nll / math.log(2) / 15)
    assert m["ppl"] == pytest.approx(math.exp(nll / 6))


class _FixedModel(torch.nn.Module):
    """Predicts ``probs`` at every position, whatever the input."""

    def __init__(self, probs):
        super().__init__()
        self.logits = torch.log(torch.tensor(probs))

    def forward(self, input_ids, position_ids=None, **kwargs):
        return SimpleNamespace(logits=self.logits.expand(*input_ids.shape, -1))


def test_evaluate_lm_against_known_distribution():
    probs = [0.1, 0.2, 0.3, 0.4]
    rows = pack_documents([[0, 1, 2, 3, 3], [0, 2]], 4, pad_id=0)
    byte_lengths = [0, 1, 1, 2]
    m = evaluate_lm(_FixedModel(probs), rows, byte_lengths, batch_size=1)
    # rows: [0 1 2 3] [3 0 2 pad]; targets: 1 2 3 | (3 restarts the row) 2 (0 restarts a document)
    targets = [1, 2, 3, 2]
    nll = -sum(math.log(probs[t]) for t in targets)
    assert m["tokens"] == 4 and m["bytes"] == 1 + 1 + 2 + 1
    assert m["loss"] == pytest.approx(nll / 4, rel=1e-6)
    assert m["bpb"] == pytest.approx(nll / math.log(2) / 5, rel=1e-6)
