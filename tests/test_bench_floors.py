"""Smoke test of ``benchmarks/floors.py`` (issue #40, Deliver 1: FLOP and byte floors per kernel).

The expected values are worked out by hand from the shapes, or counted by ``torch.utils.flop_counter.FlopCounterMode``
on explicit PyTorch versions of the same products (an independent count: it sees only the matmuls torch runs), never
taken from the script's own output.
"""

import dataclasses
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from harness import load_script  # noqa: E402  (the benchmarks folder is not a package)

floors = load_script("floors")


def _count(fn) -> int:
    with FlopCounterMode(display=False) as fc:
        fn()
    return fc.get_total_flops()


def test_hand_computed_entries_at_our_shape():
    rows = {(r.shape, r.op): r for r in floors.rows_for(floors.OURS)}
    # gate/up: 32768 tokens × top-8 = 2^18 rows, [2^18, 1024] @ [1024, 2·512]: 2 · 2^18 · 2^10 · 2^10 = 2^39 FLOP
    gate_up = rows[("ours", "gate/up fwd")]
    assert gate_up.flop == 549_755_813_888
    h200 = next(d for d in floors.DEVICES if d.name == "H200")
    us, bound = floors.floor_us(gate_up, h200)
    assert bound == "FLOP" and us == pytest.approx(549_755_813_888 / 788e12 * 1e6)  # 697.66 µs
    # short conv forward over q|k|v: C = 3 · 8 · 128 = 3072 channels, T = 32768, x read and y written in bf16
    conv = rows[("ours", "conv fwd (q, k, v as one)")]
    assert conv.bytes == 2 * 32768 * 3072 * 2 == 402_653_184
    us, bound = floors.floor_us(conv, h200)
    assert bound == "bytes" and us == pytest.approx(93.64, abs=0.01)
    # the float32 router: three GEMMs of 2 · 32768 · 1024 · 64 FLOP on 67 TFLOP/s float32 units
    router = rows[("ours", "router GEMMs fwd + ∂x + ∂W, float32")]
    us, bound = floors.floor_us(router, h200)
    assert bound == "FLOP" and us == pytest.approx(3 * 4_294_967_296 / 67e12 * 1e6)  # 192.3 µs
    # causal SDPA forward, 8 heads × 128, T = 32768: QKᵀ and PV, each 2·T²·128·8, half of them under the diagonal
    sdpa = rows[("ours", "SDPA fwd")]
    assert sdpa.flop == 2 * 2 * 32768**2 * 128 * 8 // 2


def test_gemm_and_experts_flops_match_torch_count():
    assert floors.gemm(3, 5, 7)[0] == _count(lambda: torch.randn(3, 5) @ torch.randn(5, 7))
    # a tiny MoE, forward and backward of the two expert products on every routed row, one expert at a time
    s = floors.ModelShape("tiny", tokens=6, hidden=4, kda_heads=1, kda_dim=4, mla_heads=1, mla_dim=4, kv_rank=4,
                          experts=3, local_experts=3, top_k=2, latent=5, inter=7, vocab=11)
    g = torch.Generator().manual_seed(0)
    rows_per_expert = [5, 0, 7]  # 12 = tokens · top_k routed rows, one expert empty
    x = [torch.randn(n, s.latent, generator=g, requires_grad=True) for n in rows_per_expert]
    w1 = torch.randn(s.experts, s.latent, 2 * s.inter, generator=g, requires_grad=True)
    w2 = torch.randn(s.experts, s.inter, s.latent, generator=g, requires_grad=True)

    def step():
        out = 0
        for e, xe in enumerate(x):
            gu = xe @ w1[e]
            h = F.silu(gu[:, : s.inter]) * gu[:, s.inter :]
            out = out + (h @ w2[e]).square().sum()
        out.backward()

    total = sum(f for f, _ in floors.experts_gemms(s).values())
    assert total == _count(step) == 18 * 12 * 5 * 7


def test_kda_state_pass_flops_match_torch_count():
    T, C, D = 256, 64, 16
    g = torch.Generator().manual_seed(1)
    w, u, kg, qg = (torch.randn(T, D, generator=g, requires_grad=True) for _ in range(4))
    gamma = torch.rand(T // C, D, 1, generator=g)

    S0 = torch.zeros(D, D, requires_grad=True)  # with a gradient, so the first chunk's products count in backward

    def forward():
        S, outs = S0, []
        for c in range(T // C):
            sl = slice(c * C, (c + 1) * C)
            outs.append(qg[sl] @ S)  # the inter-chunk part of the output stage
            vnew = u[sl] - w[sl] @ S
            S = S * gamma[c] + kg[sl].T @ vnew
        return torch.cat(outs).square().sum() + S.square().sum()

    st = floors.kda_stages(T, 1, D, C)
    # forward: the state pass's two products per chunk plus the output's qg·S, 2·C·D² FLOP each
    assert st["state fwd"][0] + 2 * D * D * T == _count(forward) == 3 * 2 * C * D * D * (T // C)
    loss = forward()
    # backward: two products per forward product; three of them are the state pass's, three the wy stage's
    wy_state_part = st["wy bwd"][0] - 4 * C * D * T
    assert st["state bwd"][0] + wy_state_part == _count(loss.backward) == 6 * 2 * C * D * D * (T // C)


def test_sdpa_flops_are_half_of_torchs_dense_count():
    T, heads, dim = 64, 2, 16
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(heads, T, dim, generator=g, requires_grad=True) for _ in range(3))
    mask = torch.ones(T, T, dtype=torch.bool).tril()

    def attention():  # explicit products (the CPU's fused SDPA is invisible to the counter)
        p = ((q @ k.transpose(1, 2)) / math.sqrt(dim)).masked_fill(~mask, float("-inf")).softmax(-1)
        return (p @ v).square().sum()

    dense_fwd = _count(attention)
    assert dense_fwd == 4 * T * T * dim * heads  # QKᵀ and PV over the whole square
    dense_bwd = _count(attention().backward)  # two products per forward product, P kept
    assert dense_bwd == 2 * dense_fwd
    fwd, bwd = (f for f, _ in floors.sdpa(T, heads, dim).values())
    # causal: half the square; a flash backward never stores P, so it recomputes QKᵀ (half the forward's products)
    assert fwd == dense_fwd // 2 and bwd == (dense_bwd + dense_fwd // 2) // 2


def test_measured_column_and_bad_input():
    row = floors.Row("ours", "short conv", "conv fwd", 12, 1, 1, kernels=("_conv_fwd_kernel",))
    assert floors.measured_us(row, [{"name": "_conv_fwd_kernel", "calls": 12.0, "us": 1200.0}]) == 100.0
    assert floors.measured_us(row, [{"name": "_conv_fwd_kernel", "calls": 24.0, "us": 1200.0}]) is None
    assert floors.measured_us(row, [{"name": "_other", "calls": 12.0, "us": 1200.0}]) is None
    with pytest.raises(ValueError, match="k must be a positive int, got 0"):
        floors.gemm(3, 0, 7)
    with pytest.raises(ValueError, match="C must be a positive int, got -4"):
        floors.kda_stages(64, 1, 16, -4)
    with pytest.raises(ValueError, match="tokens must be positive, got 0"):
        floors.main(["--tokens", "0"])
    with pytest.raises(ValueError, match="inter must be a positive int, got -1"):
        dataclasses.replace(floors.K3, inter=-1)
    assert math.isfinite(floors.floor_us(row, floors.DEVICES[1])[0])
