"""The comparison of ``benchmarks/router_precision.py`` (issue #40, Deliver 2: how many top-k sets a cheaper router
linear changes), checked on a hand-built case against a brute-force count in plain Python.

The case: 3 tokens, d = 2, E = 4, top-2, weights exactly representable in bf16. Token 0 sits on a near-tie built on
purpose: its second input 1.0039 rounds to 1.0 in bf16, which makes experts 1 and 2 tie in the logits, and the
correction bias (+1e-6 on expert 1) then picks expert 1 where float32 picks expert 2. Token 1's inputs are exact in
bf16; token 2's are not (1.3 → 1.296875, 0.2 → 0.2001953125) but its margins are wide. So exactly one set of three
and one slot of six change. The brute force takes the bf16 values written out above, not the script's rounding.
"""

import math
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from harness import load_script  # noqa: E402  (the benchmarks folder is not a package)

rp = load_script("router_precision")

W = [[2.0, 0.0], [1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]]
X = [[1.0, 1.0039], [0.5, -3.0], [1.3, 0.2]]
X_BF16 = [[1.0, 1.0], [0.5, -3.0], [1.296875, 0.2001953125]]  # by hand: bf16 keeps 8 significant bits
BIAS = [0.0, 1e-6, 0.0, 0.0]
TOP_K = 2


def _brute_route(x_row, bias, k):
    """Top-k set and normalised weights of one token by sorting plain Python floats."""
    scores = [1.0 / (1.0 + math.exp(-sum(a * b for a, b in zip(w, x_row, strict=True)))) for w in W]
    order = sorted(range(len(W)), key=lambda e: scores[e] + bias[e], reverse=True)[:k]
    total = sum(scores[e] for e in order)
    return set(order), {e: scores[e] / total for e in order}


def test_bf16_rounding_of_the_case_is_the_hand_value():
    assert torch.tensor(X).bfloat16().float().tolist() == X_BF16
    assert torch.tensor(W).bfloat16().float().tolist() == W


def test_compare_topk_counts_the_one_flipped_set_like_the_brute_force():
    x, w, bias = torch.tensor(X), torch.tensor(W), torch.tensor(BIAS)
    ref = x.double() @ w.double().T
    cand = rp.CANDIDATES["bf16_fp32_acc"][1](x, w)
    got = rp.compare_topk(ref, cand, bias, TOP_K)

    sets_changed = slots_changed = 0
    diffs = []
    for exact, rounded in zip(X, X_BF16, strict=True):
        r_set, r_w = _brute_route(exact, BIAS, TOP_K)
        c_set, c_w = _brute_route(rounded, BIAS, TOP_K)
        slots_changed += len(r_set - c_set)
        if r_set != c_set:
            sets_changed += 1
        else:
            diffs += [abs(r_w[e] - c_w[e]) for e in r_set]
    assert (sets_changed, slots_changed) == (1, 1)  # the case is built so (module docstring)
    assert _brute_route(X[0], BIAS, TOP_K)[0] == {0, 2} and _brute_route(X_BF16[0], BIAS, TOP_K)[0] == {0, 1}
    assert got["tokens"] == 3
    assert (got["sets_changed"], got["slots_changed"]) == (sets_changed, slots_changed)
    assert got["set_change_frac"] == pytest.approx(1 / 3) and got["slot_change_frac"] == pytest.approx(1 / 6)
    assert max(diffs) > 5e-5  # token 2's rounding moves its weights by 5.9e-5: the checks below can fail
    # the candidate's weights are float32 (as the model's), the brute force's float64: a few float32 ulps apart
    assert got["weight_max_abs_diff"] == pytest.approx(max(diffs), abs=1e-6)
    assert got["weight_mean_abs_diff"] == pytest.approx(sum(diffs) / len(diffs), abs=1e-6)


def test_float32_keeps_every_set_of_the_case():
    x, w, bias = torch.tensor(X), torch.tensor(W), torch.tensor(BIAS)
    got = rp.compare_topk(x.double() @ w.double().T, rp.CANDIDATES["float32"][1](x, w), bias, TOP_K)
    assert got["sets_changed"] == 0 and got["slots_changed"] == 0


def test_order_inside_a_set_is_not_a_change():
    # same set, swapped order of the two top experts (1 beats 0 in the candidate): no change counted
    ref = torch.tensor([[3.0, 2.0, -5.0]], dtype=torch.float64)
    cand = torch.tensor([[2.0, 3.0, -5.0]])
    got = rp.compare_topk(ref, cand, torch.zeros(3), 2)
    assert got["sets_changed"] == 0 and got["slots_changed"] == 0
    s3, s2 = 1 / (1 + math.exp(-3.0)), 1 / (1 + math.exp(-2.0))
    # expert 0 has weight s3/(s3+s2) in the reference and s2/(s3+s2) in the candidate
    assert got["weight_max_abs_diff"] == pytest.approx((s3 - s2) / (s3 + s2), rel=1e-6)


def test_round_tf32_rounds_to_nearest_even_like_float16():
    # inside float16's normal range both keep 10 mantissa bits with the same rounding: an independent reference
    g = torch.Generator().manual_seed(0)
    t = torch.randn(4096, generator=g) * 100
    ties = torch.tensor([1 + 2 ** -11, 1 + 3 * 2 ** -11, -(1 + 3 * 2 ** -11), 1 + 2 ** -11 + 2 ** -20])
    assert rp.round_tf32(ties).tolist() == [1.0, 1 + 2 ** -9, -(1 + 2 ** -9), 1 + 2 ** -10]
    assert torch.equal(rp.round_tf32(t), t.half().float())


def test_bad_inputs_raise_naming_the_value():
    with pytest.raises(ValueError, match=r"shapes differ.*\(2, 4\).*\(2, 3\)"):
        rp.compare_topk(torch.zeros(2, 4), torch.zeros(2, 3), torch.zeros(4), 2)
    with pytest.raises(ValueError, match="top_k must be in \\[1, 4\\], got 5"):
        rp.select_topk(torch.zeros(2, 4), torch.zeros(4), 5)
    with pytest.raises(ValueError, match="bias must be"):
        rp.select_topk(torch.zeros(2, 4), torch.zeros(3), 2)
    with pytest.raises(ValueError, match="float32"):
        rp.round_tf32(torch.zeros(2, dtype=torch.float64))


def test_margins_and_load_spread_by_hand():
    # token 0: biased scores σ(2)+0, σ(1)+1e-6, σ(1.0039)+0, σ(-2.0039): the 2nd and 3rd are the k-th and (k+1)-th
    x, w, bias = torch.tensor(X, dtype=torch.float64), torch.tensor(W, dtype=torch.float64), torch.tensor(BIAS)
    got = rp.margins(x @ w.T, bias, TOP_K)
    sig = [1 / (1 + math.exp(-v)) for v in (1.0039, 1.0)]
    assert got[0].item() == pytest.approx(sig[0] - (sig[1] + 1e-6), rel=1e-6)
    # 4 experts, 3 tokens × top-2: counts 3, 2, 1, 0 of 6 → shares 1/2, 1/3, 1/6, 0 against 1/4
    spread = rp.load_spread(torch.tensor([[0, 1], [0, 1], [0, 2]]), 4)
    assert spread["max_over_uniform"] == pytest.approx(2.0) and spread["min_over_uniform"] == 0.0
    shares = [1 / 2, 1 / 3, 1 / 6, 0.0]
    std = math.sqrt(sum((s - 0.25) ** 2 for s in shares) / 4)
    assert spread["cv"] == pytest.approx(std / 0.25)
