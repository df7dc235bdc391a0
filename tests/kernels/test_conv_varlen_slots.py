"""causal_conv1d_varlen_slots (the short conv of packed sequences of any length, each continuing the window its slot
keeps in a pool, the new window written back in place) against a float64 direct convolution of each sequence from
its pool row; the new windows against the inputs they must hold; rows not named keep their bits; argument errors.

Runs on the CPU interpreter (tests/conftest.py) in float32; with KDAMOE_TEST_ON_GPU=1 on a CUDA machine the same tests
run on the GPU.
"""

import os

import pytest
import torch

from kdamoe.kernels import causal_conv1d_varlen_slots
from kdamoe.kernels.utils import relative_error

ON_GPU = bool(os.environ.get("KDAMOE_TEST_ON_GPU")) and torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
TOL = 1e-5  # relative L2 against float64; float32 lands near 1e-7
P = 7  # pool rows


def direct_conv(x, weight, pool, slots, lengths, has_initial_state=None):
    """float64: for each sequence, its window (zeros without an initial state) then its tokens, convolved tap by tap
    and passed through SiLU; returns ``(y [T, C], {slot: new window [C, W]})``."""
    x, weight = x.double().cpu(), weight.double().cpu()
    W = weight.shape[1]
    y = torch.zeros(x.shape, dtype=torch.float64)
    windows, start = {}, 0
    for n, (s, L) in enumerate(zip(slots, lengths, strict=True)):
        old = pool[s].double().cpu()
        if has_initial_state is not None and not has_initial_state[n]:
            old = torch.zeros_like(old)
        seq = torch.cat([old.T, x[start:start + L]], 0)  # [W + L, C], oldest first
        for t in range(L):
            pre = sum(seq[W + t - j] * weight[:, W - 1 - j] for j in range(W))
            y[start + t] = pre * torch.sigmoid(pre)
        windows[s] = seq[-W:].T
        start += L
    return y, windows


def inputs(lengths, C, W, seed, row_stride=None):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    wide = torch.randn(T, row_stride or C, generator=gen)
    x = wide[:, 3:3 + C] if row_stride else wide  # a column slice of a wider tensor: rows row_stride apart
    weight = torch.randn(C, W, generator=gen)
    pool = torch.randn(P, C, W, generator=gen)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return x.to(DEVICE), weight.to(DEVICE), pool.to(DEVICE), cu.to(DEVICE)


@pytest.mark.parametrize("lengths,slots,C,W,parts,row_stride,seed", [
    ([5, 1, 70, 2], [4, 0, 6, 2], 48, 4, 3, None, 1),  # 70: past a 64-row tile; 2 < W − 1: the window keeps old inputs
    ([1, 3], [5, 1], 30, 3, 1, 40, 2),  # x a column slice (row stride 40), C = 30: a masked channel block
    ([9, 0, 4], [3, 6, 0], 24, 4, 2, None, 3),  # a sequence of length 0 keeps its window
])
def test_varlen_slots_equals_float64_direct_conv(lengths, slots, C, W, parts, row_stride, seed):
    x, weight, pool, cu = inputs(lengths, C, W, seed, row_stride)
    before = pool.clone()
    ids = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    ys = causal_conv1d_varlen_slots(x, weight, pool, ids, cu, parts=parts)
    ref, windows = direct_conv(x, weight, before, slots, lengths)
    assert len(ys) == parts and all(y.shape == (sum(lengths), C // parts) and y.is_contiguous() for y in ys)
    assert relative_error(torch.cat(ys, 1), ref) <= TOL
    for s, window in windows.items():  # copies of inputs: exact
        assert torch.equal(pool[s].cpu(), window.float()), s
    others = [r for r in range(P) if r not in slots]
    assert torch.equal(pool[others], before[others])  # not named: every bit kept


def test_has_initial_state_false_starts_from_zeros():
    lengths, slots, flags = [2, 6, 1], [1, 5, 3], [False, True, False]
    x, weight, pool, cu = inputs(lengths, 16, 4, 4)
    before = pool.clone()
    ys = causal_conv1d_varlen_slots(x, weight, pool, torch.tensor(slots, device=DEVICE), cu,
                                    has_initial_state=torch.tensor(flags, device=DEVICE))
    ref, windows = direct_conv(x, weight, before, slots, lengths, flags)
    assert relative_error(ys[0], ref) <= TOL
    for s, window in windows.items():
        assert torch.equal(pool[s].cpu(), window.float()), s


@pytest.mark.parametrize("slots,cu,match", [
    ([0, 7], [0, 2, 3], "max 7"),  # P = 7 rows: 7 is out of range
    ([-1, 2], [0, 2, 3], "min -1"),
    ([3, 3], [0, 2, 3], r"distinct .*\[3, 3\]"),
    ([0, 1, 2], [0, 2, 3], r"cache_indices must be \[N\] = \[2\]"),
    ([0, 1], [0, 2, 4], r"from 0 to T=3 .*\[0, 2, 4\]"),
    ([0, 1], [0, 2, 1, 3][:3], r"from 0 to T=3 .*\[0, 2, 1\]"),
])
def test_bad_indices_and_lengths_are_refused(slots, cu, match):
    x, weight, pool, _ = inputs([2, 1], 8, 4, 5)
    before = pool.clone()
    with pytest.raises(ValueError, match=match):
        causal_conv1d_varlen_slots(x, weight, pool, torch.tensor(slots, device=DEVICE),
                                   torch.tensor(cu, dtype=torch.int32, device=DEVICE))
    assert torch.equal(pool, before)


def test_other_argument_errors():
    x, weight, pool, cu = inputs([2, 1], 8, 4, 6)
    ids = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(ValueError, match="cache_indices dtype"):
        causal_conv1d_varlen_slots(x, weight, pool, ids.float(), cu)
    with pytest.raises(ValueError, match=r"conv_states must be \[P, C, W\]"):
        causal_conv1d_varlen_slots(x, weight, pool[:, :4], ids, cu)
    with pytest.raises(ValueError, match="contiguous"):
        causal_conv1d_varlen_slots(x, weight, pool.transpose(0, 1).contiguous().transpose(0, 1), ids, cu)
    with pytest.raises(ValueError, match="x must be"):
        causal_conv1d_varlen_slots(x[None], weight, pool, ids, cu)
    with pytest.raises(ValueError, match="parts"):
        causal_conv1d_varlen_slots(x, weight, pool, ids, cu, parts=3)
    with pytest.raises(ValueError, match="has_initial_state"):
        causal_conv1d_varlen_slots(x, weight, pool, ids, cu, has_initial_state=torch.ones(2, device=DEVICE))
    with pytest.raises(ValueError, match="no backward"):
        causal_conv1d_varlen_slots(x.requires_grad_(), weight, pool, ids, cu)
