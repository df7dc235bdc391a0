"""SiTU-GLU, the torch experts, and the router-bias balancers (Quantile Balancing vs sign vs none)."""

import pytest
import torch
from moe_reference import moe_experts_ref

from kdamoe.model.modeling_kdamoe import KDAMoETopkRouter
from kdamoe.model.moe_torch import GLUActivation, moe_experts_torch, situ_glu
from kdamoe.model.quantile_balancing import histogram_range, qb_histogram, quantile_from_histogram
from tests.helpers import tiny_config


def test_situ_glu_is_capped_and_equals_swiglu_near_zero():
    gen = torch.Generator().manual_seed(0)
    a = 1e3 * torch.randn(10000, generator=gen, dtype=torch.float64)
    b = 1e3 * torch.randn(10000, generator=gen, dtype=torch.float64)
    out = situ_glu(a, b, 4.0, 25.0)
    assert float(out.abs().max()) <= 4.0 * 25.0
    assert float(out.abs().max()) > 0.9 * 4.0 * 25.0  # the cap is reached, not just respected
    moderate = situ_glu(a / 100, b / 100, 4.0, 25.0)
    assert float(moderate.abs().max()) < 4.0 * 25.0
    small_a = 1e-3 * torch.randn(1000, generator=gen, dtype=torch.float64)
    small_b = 1e-3 * torch.randn(1000, generator=gen, dtype=torch.float64)
    swiglu = torch.nn.functional.silu(small_a) * small_b
    torch.testing.assert_close(situ_glu(small_a, small_b), swiglu, rtol=1e-6, atol=0)
    # Formula, term by term.
    x, y = torch.tensor([3.0], dtype=torch.float64), torch.tensor([-40.0], dtype=torch.float64)
    expected = 4 * torch.tanh(x / 4) * torch.sigmoid(x) * 25 * torch.tanh(y / 25)
    torch.testing.assert_close(situ_glu(x, y), expected)


@pytest.mark.parametrize("hidden_act", ["situ", "silu"])
def test_torch_experts_match_brute_force_and_skip_foreign_tokens(hidden_act):
    gen = torch.Generator().manual_seed(1)
    N, L, I, E, k = 23, 8, 6, 5, 2
    x = torch.randn(N, L, generator=gen, dtype=torch.float64, requires_grad=True)
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(N)])
    idx[idx == 4] = 0  # expert 4 gets no tokens
    idx[::5, 1] = E  # owned by another rank: skipped
    w = torch.rand(N, k, generator=gen, dtype=torch.float64, requires_grad=True)
    gate_up = torch.randn(E, 2 * I, L, generator=gen, dtype=torch.float64, requires_grad=True)
    down = torch.randn(E, L, I, generator=gen, dtype=torch.float64, requires_grad=True)
    act = GLUActivation(hidden_act)
    out = moe_experts_torch(x, idx, w, gate_up, down, act)
    ref = moe_experts_ref(x, idx, w, gate_up, down, activation=hidden_act)
    torch.testing.assert_close(out, ref)
    grads = torch.autograd.grad(out.square().sum(), (x, w, gate_up, down))
    grads_ref = torch.autograd.grad(ref.square().sum(), (x, w, gate_up, down))
    for got, want in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(got, want)


def test_histogram_quantile_within_one_bin_of_exact():
    gen = torch.Generator().manual_seed(2)
    bias = 0.3 * torch.randn(6, generator=gen)
    lo, hi = histogram_range(bias)
    r = torch.rand(5000, 6, generator=gen) * (hi - lo) + lo
    r[:, 0] = r[:, 0] * 0.1  # a narrow column
    counts = qb_histogram(r, lo, hi, 1024)
    assert counts.sum().item() == r.numel()
    q = 2 / 6
    exact = torch.quantile(r.double(), q, dim=0)
    approx = quantile_from_histogram(counts, lo, hi, q)
    assert float((approx - exact).abs().max()) <= (hi - lo) / 1024


def _skewed_router(rule, seed=0):
    config = tiny_config(hidden_size=32, num_experts=16, num_experts_per_tok=2, router_bias_update=rule,
                         router_bias_update_rate=1e-3)
    router = KDAMoETopkRouter(config)
    gen = torch.Generator().manual_seed(seed)
    direction = torch.randn(32, generator=gen)
    direction = direction / direction.norm()
    with torch.no_grad():
        # Experts' affinity for a shared input direction grows linearly: a deliberately skewed router.
        router.weight.copy_(0.3 * torch.randn(16, 32, generator=gen) + torch.linspace(-2, 2, 16)[:, None] * direction)
    return router, direction


def _load_imbalance(router, direction, steps, seed=0):
    """max/mean load on a fresh 32K-token batch after ``steps`` updates of 8K tokens each."""
    gen = torch.Generator().manual_seed(100 + seed)
    router.train()
    for _ in range(steps):
        router(torch.randn(8192, 32, generator=gen) + 1.5 * direction)
        router.update_bias()
    router(torch.randn(32768, 32, generator=gen) + 1.5 * direction)
    load = router.expert_load()
    router.reset_statistics()
    return float(load.max() / load.mean())


def test_quantile_balancing_beats_sign_rule_and_no_balancing_on_a_skewed_router():
    imbalance = {}
    for rule in ("quantile", "sign", "none"):
        router, direction = _skewed_router(rule)
        imbalance[rule] = _load_imbalance(router, direction, steps=10)
    assert imbalance["none"] > 3.0, imbalance  # the router really is skewed
    assert imbalance["quantile"] < 1.10, imbalance
    assert imbalance["sign"] > 2 * imbalance["quantile"], imbalance  # 1e-3 steps move slowly


def test_statistics_counted_only_in_training_with_grad_and_not_for_padding():
    router, direction = _skewed_router("quantile")
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(3))
    router.eval()
    router(x)
    assert router.expert_load().sum() == 0
    router.train()
    with torch.no_grad():
        router(x)
    assert router.expert_load().sum() == 0
    mask = torch.arange(64) < 40
    router(x, token_mask=mask)
    assert router.expert_load().sum() == 40 * 2
    assert router.qb_counts.sum() == 40 * 16
    bias_before = router.e_score_correction_bias.clone()
    router.update_bias()
    assert not torch.equal(bias_before, router.e_score_correction_bias)
    assert abs(float(router.e_score_correction_bias.mean())) < 1e-6
    assert router.expert_load().sum() == 0


def test_gradient_accumulation_update_equals_one_big_batch():
    router_a, direction = _skewed_router("quantile")
    router_b, _ = _skewed_router("quantile")
    x = torch.randn(512, 32, generator=torch.Generator().manual_seed(4)) + direction
    router_a.train(), router_b.train()
    router_a(x)
    for part in x.chunk(4):
        router_b(part)
    router_a.update_bias(), router_b.update_bias()
    torch.testing.assert_close(router_a.e_score_correction_bias, router_b.e_score_correction_bias)
