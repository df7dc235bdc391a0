"""moe_route (Triton, interpreter on CPU) against brute-force torch: picks, weights, token counts, QB
histogram, gradient; QB quantiles from the kernel's counts against exact quantiles; and the model's router
with the kernel against the router with the PyTorch op."""

import math
import os

import pytest
import torch
from moe_reference import histogram_ref, margins_ref, moe_route_ref

import kdamoe.kernels
from kdamoe.kernels import moe_route
from kdamoe.model.modeling_kdamoe import KDAMoETopkRouter
from kdamoe.model.moe_torch import moe_route_torch
from kdamoe.model.quantile_balancing import histogram_range, qb_histogram, quantile_from_histogram, selection_margins
from tests.helpers import tiny_config

# These run the routing kernel on CPU tensors through the Triton interpreter; on a GPU machine (KDAMOE_TEST_ON_GPU=1)
# the same code paths are checked on CUDA by tests/test_gpu_backends.py and the benchmarks' agreement columns.
pytestmark = pytest.mark.skipif(bool(os.environ.get("KDAMOE_TEST_ON_GPU")), reason="CPU-interpreter test")


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
    out = moe_route(logits, bias, k, count_tokens=True, num_bins=1024)
    sel, w, _, s = moe_route_ref(logits, bias, k)
    assert torch.equal(out.top_k_index, sel)
    assert out.top_k_weights.dtype == torch.float32
    torch.testing.assert_close(out.top_k_weights.double(), w, rtol=1e-5, atol=1e-6)
    assert out.tokens_per_expert.dtype == torch.float64 and out.histogram.dtype == torch.float64
    assert torch.equal(out.tokens_per_expert, torch.bincount(sel.flatten(), minlength=e).double())
    lo, hi = histogram_range(bias)
    hist = out.histogram.long()
    assert hist.shape == (e, 1024) and hist.sum() == n * e
    r64 = margins_ref(s, bias, sel, k)
    diff = (hist - histogram_ref(r64, lo, hi)).abs().sum().item()
    assert diff <= 2 * near_edge(r64, lo, hi)
    # same counts as the pure-PyTorch QB module on the float32 r of the same routing
    s32 = torch.sigmoid(logits.float())
    r32 = selection_margins(s32, (s32 + bias).topk(k + 1, dim=-1).values, out.top_k_index)
    diff = (out.histogram - qb_histogram(r32, lo, hi, 1024)).abs().sum().item()
    assert diff <= 2 * near_edge(r32, lo, hi, tol=1e-6)


def test_route_statistics_leave_out_masked_tokens():
    logits, bias = inputs(40, 16, 4)
    mask = torch.rand(40, generator=torch.Generator().manual_seed(5)) < 0.6
    out = moe_route(logits, bias, 3, token_mask=mask, count_tokens=True, num_bins=1024)
    sel, _, _, s = moe_route_ref(logits, bias, 3)
    lo, hi = histogram_range(bias)
    r = margins_ref(s, bias, sel, 3)[mask]
    assert 0 < mask.sum() < 40 and out.histogram.sum() == mask.sum() * 16
    assert (out.histogram.long() - histogram_ref(r, lo, hi)).abs().sum() <= 2 * near_edge(r, lo, hi)
    assert torch.equal(out.tokens_per_expert, torch.bincount(sel[mask].flatten(), minlength=16).double())
    assert torch.equal(out.top_k_index, sel)  # routing itself ignores the mask
    again = moe_route(logits, bias, 3, token_mask=mask.int(), count_tokens=True, num_bins=1024)  # int mask
    assert torch.equal(again.histogram, out.histogram) and torch.equal(again.tokens_per_expert, out.tokens_per_expert)
    bare = moe_route(logits, bias, 3)
    assert bare.tokens_per_expert is None and bare.histogram is None


@pytest.mark.parametrize("n, e, k, dtype, seed", [(30, 12, 4, torch.float32, 6), (37, 64, 8, torch.float32, 8),
                                                   (21, 100, 6, torch.float16, 9)])
def test_route_gradient(n, e, k, dtype, seed):
    # the backward kernel against float64 autograd of the same formula; n not a multiple of the token tile, E not
    # a power of two (12, 100), float16 logits (their gradient comes back in float16)
    logits, bias = inputs(n, e, seed)
    logits = logits.to(dtype)
    lg = logits.clone().requires_grad_()
    out = moe_route(lg, bias, k, routed_scaling_factor=2.5)
    gw = torch.randn(n, k, generator=torch.Generator().manual_seed(seed + 1))
    (out.top_k_weights * gw).sum().backward()
    l64 = logits.double().requires_grad_()
    s = torch.sigmoid(l64)
    sel = torch.topk(s + bias.double(), k + 1, dim=-1).indices[:, :k]
    ss = s.gather(1, sel)
    (2.5 * ss / ss.sum(-1, keepdim=True) * gw.double()).sum().backward()
    assert l64.grad.abs().max() > 0 and lg.grad.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-3, atol=1e-5)
    torch.testing.assert_close(lg.grad.double(), l64.grad, **tol)
    assert (lg.grad != 0).sum(-1).max() <= k  # only the dispatched experts get gradient


def exact_quantile(r, q):
    """Sample q-quantile per column: the ceil(q·n)-th smallest value (inverse empirical CDF)."""
    kth = max(1, math.ceil(q * r.shape[0] - 1e-9))
    return torch.sort(r, dim=0).values[kth - 1]


def test_route_quantile_from_kernel_histogram():
    n, e, k = 400, 16, 2
    logits, bias = inputs(n, e, 9, bias_scale=0.05)
    out = moe_route(logits, bias, k, num_bins=1024)
    lo, hi = histogram_range(bias)
    q = k / e
    est = quantile_from_histogram(out.histogram, lo, hi, q)
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
    with pytest.raises(ValueError, match="num_bins"):
        moe_route(logits, bias, 2, num_bins=0)
    with pytest.raises(ValueError, match="one device"):
        moe_route(logits, bias.to("meta"), 2)


def _router_case(rule, seed):
    """A router with a random selection bias and a batch of 48 tokens whose last 13 are padding."""
    config = tiny_config(hidden_size=32, num_experts=16, num_experts_per_tok=3, router_bias_update=rule)
    torch.manual_seed(seed)
    router = KDAMoETopkRouter(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=gen) * 0.5)
        router.e_score_correction_bias.copy_(torch.randn(16, generator=gen) * 0.1)
    x = torch.randn(48, 32, generator=gen)
    mask = torch.arange(48) < 35
    return router, x, mask


def _run_router(router, backend, x, mask):
    router.config.kernel_backend = backend
    router.zero_grad(set_to_none=True)
    router.reset_statistics()
    logits, index, weights = router(x, token_mask=mask)
    (weights * torch.linspace(-1, 1, weights.numel()).view_as(weights)).sum().backward()
    return index, weights.detach(), router.weight.grad, router.tokens_per_expert.clone(), router.qb_counts.clone()


@pytest.mark.parametrize("rule,seed", [("quantile", 11), ("sign", 12)])
def test_model_router_triton_equals_torch_on_padded_batch(rule, seed, monkeypatch):
    router, x, mask = _router_case(rule, seed)
    router.train()
    calls = []
    kernel = kdamoe.kernels.moe_route
    monkeypatch.setattr(kdamoe.kernels, "moe_route", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    idx_t, w_t, grad_t, load_t, qb_t = _run_router(router, "torch", x, mask)
    assert not calls
    idx_k, w_k, grad_k, load_k, qb_k = _run_router(router, "triton", x, mask)
    assert calls, "the model's router did not call the Triton kernel"
    assert torch.equal(idx_k, idx_t)
    torch.testing.assert_close(w_k, w_t, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad_k, grad_t, rtol=1e-5, atol=1e-7)
    assert load_k.dtype == torch.float64 and qb_k.dtype == torch.float64
    assert torch.equal(load_k, load_t) and load_t.sum() == 35 * 3  # padding is not counted
    if rule == "quantile":
        assert qb_t.sum() == 35 * 16
        # sigmoid may differ by an ulp between the kernel and torch: only values at a bin edge may move
        s = torch.sigmoid(x.double() @ router.weight.detach().double().T)
        r = margins_ref(s, router.e_score_correction_bias, idx_t, 3)[mask]
        lo, hi = histogram_range(router.e_score_correction_bias)
        assert (qb_k - qb_t).abs().sum() <= 2 * near_edge(r, lo, hi)
    else:
        assert qb_t.sum() == 0 and qb_k.sum() == 0  # the sign rule needs no histogram


def test_model_router_counts_only_in_training_with_grad():
    router, x, mask = _router_case("quantile", 13)
    for backend in ("torch", "triton"):
        router.config.kernel_backend = backend
        router.reset_statistics()
        router.eval()
        router(x, token_mask=mask)
        router.train()
        with torch.no_grad():
            router(x, token_mask=mask)
        # reset_statistics zeroes counts in place once they exist (a captured training step keeps counting into them)
        assert router.tokens_per_expert is None or not router.tokens_per_expert.any(), backend
        assert router.expert_load().sum() == 0, backend


def test_torch_route_op_matches_bruteforce():
    logits, bias = inputs(30, 10, 14)
    mask = torch.rand(30, generator=torch.Generator().manual_seed(15)) < 0.7
    idx, w, load, hist = moe_route_torch(logits, bias, 3, 2.0, token_mask=mask, count_tokens=True, num_bins=64)
    sel, w_ref, _, s = moe_route_ref(logits, bias, 3, scaling=2.0)
    assert torch.equal(idx, sel)
    torch.testing.assert_close(w.double(), w_ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(load, torch.bincount(sel[mask].flatten(), minlength=10).double())
    lo, hi = histogram_range(bias)
    r = margins_ref(s, bias, sel, 3)[mask]
    assert (hist.long() - histogram_ref(r, lo, hi, 64)).abs().sum() <= 2 * near_edge(r, lo, hi, 64)
    with pytest.raises(ValueError, match="top_k"):
        moe_route_torch(logits, bias, 10)


def test_model_router_after_a_blanket_bfloat16_cast():
    """``model.to(torch.bfloat16)`` casts the bias buffer too; the kernel (float32 bias only) still runs."""
    router, x, mask = _router_case("quantile", 16)
    router.e_score_correction_bias.data = router.e_score_correction_bias.bfloat16()
    router.train()
    idx_t = _run_router(router, "torch", x, mask)[0]
    idx_k = _run_router(router, "triton", x, mask)[0]
    assert torch.equal(idx_k, idx_t)
