"""Packing: position restarts, label masking and token conservation, checked by brute force."""

import random

import pytest
import torch

from kdamoe.training.data import IGNORE_INDEX, PackedStageDataset, pack_documents, stage_loader

PAD = 0


def _random_docs(seed, n_docs=12, max_len=40):
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 50) for _ in range(rng.randrange(0, max_len))] + [2] for _ in range(n_docs)]


@pytest.mark.parametrize("seq_len", [2, 5, 16, 64])
@pytest.mark.parametrize("seed", [0, 1])
def test_pack_brute_force(seq_len, seed):
    docs = _random_docs(seed)
    rows = pack_documents(docs, seq_len, PAD)
    ids, pos, labels = rows["input_ids"], rows["position_ids"], rows["labels"]
    assert ids.shape == pos.shape == labels.shape and ids.shape[1] == seq_len and ids.dtype == torch.long

    # Walk the documents token by token and predict every field independently.
    stream = [(t, d_i, j) for d_i, d in enumerate(docs) for j, t in enumerate(d)]
    n_real = len(stream)
    assert ids.numel() == -(-n_real // seq_len) * seq_len
    for flat in range(ids.numel()):
        r, c = divmod(flat, seq_len)
        if flat >= n_real:  # padding tail
            assert ids[r, c] == PAD and labels[r, c] == IGNORE_INDEX
            assert pos[r, c] == (0 if flat == n_real or c == 0 else pos[r, c - 1] + 1)
            continue
        token, doc, offset = stream[flat]
        assert ids[r, c] == token
        restart = offset == 0 or c == 0
        expected_pos = 0 if restart else pos[r, c - 1] + 1
        assert pos[r, c] == expected_pos
        assert labels[r, c] == (IGNORE_INDEX if restart else token)
        if not restart:  # the position counts tokens since the later of document start and row start
            assert pos[r, c] == min(offset, c)

    # Every document's tokens appear exactly once, in order, and nothing else but padding.
    assert ids.flatten()[:n_real].tolist() == [t for d in docs for t in d]


def test_pack_drop_last_and_errors():
    docs = [[1, 5, 6, 2], [1, 7, 2]]
    rows = pack_documents(docs, 3, PAD, drop_last=True)
    assert rows["input_ids"].tolist() == [[1, 5, 6], [2, 1, 7]]
    assert rows["position_ids"].tolist() == [[0, 1, 2], [0, 0, 1]]
    assert rows["labels"].tolist() == [[IGNORE_INDEX, 5, 6], [IGNORE_INDEX, IGNORE_INDEX, 7]]
    with pytest.raises(ValueError, match="seq_len"):
        pack_documents(docs, 1, PAD)
    with pytest.raises(ValueError, match="no tokens"):
        pack_documents([], 4, PAD)


def test_stage_dataset_epochs_are_permutations_and_deterministic():
    n = 7
    rows = {"input_ids": torch.arange(n).unsqueeze(1).repeat(1, 3)}
    ds = PackedStageDataset(rows, length=3 * n, seed=5)
    order = [int(ds[i]["input_ids"][0]) for i in range(len(ds))]
    for e in range(3):
        assert sorted(order[e * n:(e + 1) * n]) == list(range(n))
    assert order[:n] != order[n:2 * n]  # a fresh order each epoch
    again = PackedStageDataset(rows, length=3 * n, seed=5)
    assert [int(again[i]["input_ids"][0]) for i in reversed(range(len(ds)))] == order[::-1]
    with pytest.raises(IndexError):
        ds[3 * n]


def test_stage_loader_yields_exact_number_of_batches():
    rows = pack_documents(_random_docs(0), 8, PAD)
    loader = stage_loader(rows, batch_size=3, num_micro_batches=5, seed=0)
    batches = list(loader)
    assert len(batches) == 5 and all(b["input_ids"].shape == (3, 8) for b in batches)
    assert set(batches[0]) == {"input_ids", "position_ids", "labels"}
