"""``benchmarks/bench_moe.py --router-linear`` (issue #40, Deliver 2: the router linear in float32 against cheaper
GEMMs), smoke-run on the CPU at tiny sizes, and its bf16 autograd Functions checked against explicit float64
products (∂x = ∂y·W, ∂W = ∂yᵀ·x) computed here. Not how fast anything is."""

import json
import math
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from harness import load_script  # noqa: E402  (the benchmarks folder is not a package)

bench_moe = load_script("bench_moe")


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("cls, fwd_tol", [("RouterLinearBF16", 2e-2), ("RouterLinearBF16x3", 1e-4)])
def test_router_linear_functions_match_float64_products(cls, fwd_tol):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(33, 40, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(12, 40, generator=g) / 40 ** 0.5).requires_grad_()
    dy = torch.randn(33, 12, generator=g)
    out = getattr(bench_moe, cls).apply(x, w)
    out.backward(dy)
    x64, w64, dy64 = x.detach().double(), w.detach().double(), dy.double()
    assert out.dtype == torch.float32 and x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    assert _rel(out.detach(), x64 @ w64.T) < fwd_tol
    # the backward reads bf16 operands: bf16-level errors (8 significant bits), but no more
    assert _rel(x.grad, dy64 @ w64) < 2e-2 and _rel(w.grad, dy64.T @ x64) < 2e-2
    if cls == "RouterLinearBF16x3":  # the split must beat plain bf16 by orders of magnitude, or it is not there
        plain = bench_moe.RouterLinearBF16.apply(x.detach(), w.detach())
        assert _rel(out.detach(), x64 @ w64.T) * 100 < _rel(plain, x64 @ w64.T)


def test_bf16x3_on_float32_x_uses_the_split_of_x():
    # float32 x (not bf16 values): the third product x_lo·W_hi is what keeps the error near 2^-16, not 2^-9
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 96, generator=g)
    w = torch.randn(16, 96, generator=g) / 96 ** 0.5
    ref = x.double() @ w.double().T
    err3 = _rel(bench_moe.RouterLinearBF16x3.apply(x, w), ref)
    err_w_only = _rel(bench_moe.RouterLinearBF16x3.apply(x.bfloat16(), w), ref)  # x rounded first: bf16-level
    assert err3 < 5e-5 and err_w_only > 1e-3, (err3, err_w_only)


def test_router_linear_smoke_writes_every_variant(tmp_path):
    bench_moe.main(["--smoke", "--router-linear", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "router_linear.json").read_text())
    variants = {"float32", "tf32", "bf16_fp32_out", "bf16x3_fwd", "bf16_out"}
    assert {(r["shape"], r["variant"]) for r in doc["rows"]} == {(s, v) for s in ("tiny", "tiny_wide")
                                                                  for v in variants}
    for r in doc["rows"]:
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("fwd_ms", "fwdbwd_ms")), r
        assert 0 <= r["rel_err_logits"] < 2e-2 and 0 <= r["rel_err_dx"] < 2e-2 and 0 <= r["rel_err_dw"] < 2e-2, r
        if r["variant"] == "float32":  # float32 products of bf16 x and float32 W against float64: float32 rounding
            assert r["rel_err_logits"] < 1e-6 and r["rel_err_dw"] < 1e-6, r
    assert str(tmp_path) not in (tmp_path / "router_linear.md").read_text()
