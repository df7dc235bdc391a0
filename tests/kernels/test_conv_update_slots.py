"""causal_conv1d_update_slots (one short-conv decode step per sequence, its window shifted in place in a slot pool)
against the engine's former path (gather the windows, the PyTorch conv ``causal_conv1d_torch``, scatter) and a float64
loop over the taps; slots not named keep their bits; argument errors.

Runs on the CPU interpreter (tests/conftest.py) in float32 and float16; with KDAMOE_TEST_ON_GPU=1 on a CUDA
machine the same tests run on the GPU.
"""

import os

import pytest
import torch

from kdamoe.kernels import causal_conv1d_update_slots
from kdamoe.kernels.utils import relative_error
from kdamoe.model.kda_torch import causal_conv1d_torch

ON_GPU = bool(os.environ.get("KDAMOE_TEST_ON_GPU")) and torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}  # relative L2 against float64


def conv_brute_force(x, pool, slots, weight):
    """float64 loop over the taps: the new window of each named slot and the SiLU of its weighted sum."""
    pool = pool.double().clone()
    y = torch.zeros(x.shape, dtype=torch.float64)
    W = weight.shape[1]
    for n, s in enumerate(slots):
        window = torch.cat([pool[s, :, 1:], x[n].double()[:, None]], 1)
        for c in range(x.shape[1]):
            pre = sum(float(window[c, m]) * float(weight[c, m]) for m in range(W))
            y[n, c] = pre / (1 + torch.exp(torch.tensor(-pre, dtype=torch.float64)))
        pool[s] = window
    return y, pool


@pytest.mark.parametrize("dtype,C,W,slots,seed", [
    (torch.float32, 12, 4, [2, 0, 4], 41),
    (torch.float16, 70, 4, [1, 3], 42),  # C = 70: a masked channel block
    (torch.float32, 10, 3, [4], 43),
    (torch.float16, 8, 1, [0, 1], 44),  # W = 1: the window is the new input alone
])
def test_conv_slots_equals_gather_op_scatter_and_brute_force(dtype, C, W, slots, seed):
    gen = torch.Generator().manual_seed(seed)
    N = len(slots)
    wide = torch.randn(N, C + 5, generator=gen).to(dtype).to(DEVICE)
    x = wide[:, 5:]  # a column slice: rows C + 5 apart, read in place
    weight = (torch.randn(C, W, generator=gen) / W ** 0.5).to(dtype).to(DEVICE)
    pool = torch.randn(5, C, W, generator=gen).to(dtype).to(DEVICE)
    before = pool.clone()
    ids = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    y = causal_conv1d_update_slots(x, pool, ids, weight)
    assert y.shape == (N, C) and y.dtype == dtype

    # the engine's former path on the CPU: gather, the PyTorch conv op on one token, scatter
    want_pool = before.clone().cpu()
    ref_y, new_state = causal_conv1d_torch(x.cpu()[:, None].double(), weight.cpu().double(),
                                           want_pool[ids.long().cpu()].double())
    want_pool[ids.long().cpu()] = new_state.to(dtype)
    assert relative_error(y, ref_y[:, 0]) <= TOL[dtype]
    assert torch.equal(pool.cpu(), want_pool)  # the window is copied, never rounded: bit for bit

    bf_y, bf_pool = conv_brute_force(x.cpu(), before.cpu(), slots, weight.cpu())
    assert relative_error(y, bf_y) <= TOL[dtype] and torch.equal(pool.cpu().double(), bf_pool)


def test_conv_slots_argument_errors():
    x = torch.randn(2, 6, device=DEVICE)
    weight = torch.randn(6, 4, device=DEVICE)
    pool = torch.zeros(3, 6, 4, device=DEVICE)
    ids = torch.tensor([0, 2], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"x must be \[N, C\]"):
        causal_conv1d_update_slots(x[:, None], pool, ids, weight)
    with pytest.raises(ValueError, match=r"conv_pool must be \[num_slots, C, W\] = \(num_slots, 6, 4\)"):
        causal_conv1d_update_slots(x, pool[..., :3], ids, weight)
    with pytest.raises(ValueError, match="conv_pool dtype"):
        causal_conv1d_update_slots(x, pool.long(), ids, weight)
    with pytest.raises(ValueError, match="conv_pool must be contiguous"):
        causal_conv1d_update_slots(x, pool.transpose(1, 2).contiguous().transpose(1, 2), ids, weight)
    with pytest.raises(ValueError, match="weight must be"):
        causal_conv1d_update_slots(x, pool, ids, weight[:5])
    with pytest.raises(ValueError, match="slot_ids must be distinct"):
        causal_conv1d_update_slots(x, pool, ids * 0, weight)
    with pytest.raises(ValueError, match=r"slot_ids must lie in \[0, num_slots=3\)"):
        causal_conv1d_update_slots(x, pool, ids + 1, weight)
    with pytest.raises(ValueError, match="slot_ids must be a torch.Tensor"):
        causal_conv1d_update_slots(x, pool, [0, 2], weight)
    with pytest.raises(ValueError, match="no backward"):
        causal_conv1d_update_slots(x.clone().requires_grad_(), pool, ids, weight)
