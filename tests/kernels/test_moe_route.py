"""moe_route (Triton, interpreter on CPU) against brute-force torch: picks, weights, α, QB histogram,
gradient, permutation; QB quantiles from the kernel's counts against exact quantiles."""

import math

import pytest
import torch
from moe_reference import histogram_ref, margins_ref, moe_route_ref

from kdamoe.kernels import moe_route
from kdamoe.quantile_balancing import histogram_range, qb_histogram, quantile_from_histogram, selection_margins


def inputs(n, e, seed, dtype=torch.float32, bias_scale=0.3):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, e, generator=g) * 2.0).to(dtype)
    bias = torch.randn(e, generator=g) * bias_scale
    return logits, bias


def near_edge(r, lo, hi, num_bins=1024, tol=1e-6):
    """How many values lie within tol of a bin edge (where float32 and float64 may disagree)."""
    width = (hi - lo) / num_bins
    pos = (r.double() - lo) / width
    return ((pos - pos.round()).abs() * width < tol).sum().item()


@pytest.mark.parametrize("n,e,k,dtype,seed", [(50, 40, 5, torch.float32, 0), (33, 8, 2, torch.float16, 1),
                                              (6, 1000, 16, torch.float32, 2), (20, 3, 2, torch.float32, 3)])
def test_route_matches_bruteforce(n, e, k, dtype, seed):
    logits, bias = inputs(n, e, seed, dtype)
    out = moe_route(logits, bias, k, compute_histogram=True)
    sel, w, alpha, s = moe_route_ref(logits, bias, k)
    assert torch.equal(out.top_k_index, sel)
    assert out.top_k_weights.dtype == torch.float32 and out.alpha.dtype == torch.float32
    torch.testing.assert_close(out.top_k_weights.double(), w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.alpha.double(), alpha, rtol=1e-5, atol=1e-6)
    lo, hi = histogram_range(bias)
    hist = out.histogram.long()
    assert hist.shape == (e, 1024) and hist.sum() == n * e
    r64 = margins_ref(s, bias, sel, k)
    diff = (hist - histogram_ref(r64, lo, hi)).abs().sum().item()
    assert diff <= 2 * near_edge(r64, lo, hi)
    # same counts as the pure-PyTorch QB module on the float32 r of the same routing
    s32 = torch.sigmoid(logits.float())
    r32 = selection_margins(s32, (s32 + bias).topk(k + 1, dim=-1).values, out.top_k_index)
    diff = (out.histogram.double() - qb_histogram(r32, lo, hi, 1024)).abs().sum().item()
    assert diff <= 2 * near_edge(r32, lo, hi, tol=1e-6)


def test_route_histogram_mask_and_accumulate():
    logits, bias = inputs(40, 16, 4)
    mask = torch.rand(40, generator=torch.Generator().manual_seed(5)) < 0.6
    hist = torch.zeros(16, 1024, dtype=torch.int32)
    out = moe_route(logits, bias, 3, token_mask=mask, histogram=hist)
    assert out.histogram is hist
    sel, w, alpha, s = moe_route_ref(logits, bias, 3)
    lo, hi = histogram_range(bias)
    r = margins_ref(s, bias, sel, 3)[mask]
    assert hist.sum() == mask.sum() * 16 and 0 < mask.sum() < 40
    assert (hist.long() - histogram_ref(r, lo, hi)).abs().sum() <= 2 * near_edge(r, lo, hi)
    before = hist.clone()
    moe_route(logits, bias, 3, token_mask=mask.int(), histogram=hist)  # accumulates (int mask accepted)
    assert torch.equal(hist, 2 * before)
    # routing itself ignores the mask
    assert torch.equal(out.top_k_index, sel)


def test_route_gradient():
    logits, bias = inputs(30, 12, 6)
    lg = logits.clone().requires_grad_()
    out = moe_route(lg, bias, 4, routed_scaling_factor=2.5)
    gw = torch.randn(30, 4, generator=torch.Generator().manual_seed(7))
    (out.top_k_weights * gw).sum().backward()
    l64 = logits.double().requires_grad_()
    s = torch.sigmoid(l64)
    sel = torch.topk(s + bias.double(), 5, dim=-1).indices[:, :4]
    ss = s.gather(1, sel)
    (2.5 * ss / ss.sum(-1, keepdim=True) * gw.double()).sum().backward()
    assert l64.grad.abs().max() > 0
    torch.testing.assert_close(lg.grad.double(), l64.grad, rtol=1e-5, atol=1e-6)
    assert (lg.grad != 0).sum(-1).max() <= 4  # only the dispatched experts get gradient


def test_route_permutation():
    logits, bias = inputs(37, 9, 8)
    out = moe_route(logits, bias, 3)
    flat = out.top_k_index.flatten()
    order = out.order.long()
    assert sorted(order.tolist()) == list(range(37 * 3))
    assert (flat[order][1:] >= flat[order][:-1]).all()
    counts = torch.bincount(flat, minlength=9)
    assert torch.equal(out.tokens_per_expert.long(), counts)
    assert torch.equal(out.expert_offsets.long(), torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]))
    for e in range(9):  # stable: tokens keep their order inside an expert
        seg = order[out.expert_offsets[e]:out.expert_offsets[e + 1]]
        assert (seg[1:] > seg[:-1]).all()


def exact_quantile(r, q):
    """Sample q-quantile per column: the ceil(q·n)-th smallest value (inverse empirical CDF)."""
    kth = max(1, math.ceil(q * r.shape[0] - 1e-9))
    return torch.sort(r, dim=0).values[kth - 1]


def test_route_quantile_from_kernel_histogram():
    n, e, k = 400, 16, 2
    logits, bias = inputs(n, e, 9, bias_scale=0.05)
    out = moe_route(logits, bias, k, compute_histogram=True)
    lo, hi = histogram_range(bias)
    q = k / e
    est = quantile_from_histogram(out.histogram.double(), lo, hi, q)
    sel, _, _, s = moe_route_ref(logits, bias, k)
    exact = exact_quantile(margins_ref(s, bias, sel, k), q)
    width = (hi - lo) / 1024
    assert (est - exact).abs().max() <= width + 1e-6


def test_route_errors():
    logits, bias = inputs(8, 6, 10)
    with pytest.raises(ValueError, match="top_k"):
        moe_route(logits, bias, 6)  # needs k < E for the (k+1)-th score
    with pytest.raises(ValueError, match="top_k"):
        moe_route(logits, bias, 0)
    with pytest.raises(ValueError, match="router_logits"):
        moe_route(logits[0], bias, 2)
    with pytest.raises(ValueError, match="router_logits"):
        moe_route(logits.long(), bias, 2)
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        moe_route(logits, bias[:5], 2)
    with pytest.raises(ValueError, match="float32"):
        moe_route(logits, bias.double(), 2)
    with pytest.raises(ValueError, match="token_mask"):
        moe_route(logits, bias, 2, token_mask=torch.ones(7))
    with pytest.raises(ValueError, match="histogram"):
        moe_route(logits, bias, 2, histogram=torch.zeros(6, 1024))
    with pytest.raises(ValueError, match="one device"):
        moe_route(logits, bias.to("meta"), 2)
