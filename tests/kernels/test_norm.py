"""rms_norm / gated_rms_norm (Triton) against two references: the formula in float64 differentiated by
torch.autograd (no rounding at all), and ``kdamoe.model.norm_torch`` in the same dtype (the same rounding points, so
outputs agree to one rounding). Outputs and the gradients of x, weight and gate; odd widths, leading dims, a
zero row, weight dtypes other than x's (type promotion), strided inputs, argument errors, the dispatch.

Runs on the CPU interpreter (tests/conftest.py) in float32 and float16; with KDAMOE_TEST_ON_GPU=1 on a CUDA
machine the same tests run on the GPU (add bfloat16 there: the interpreter mishandles it).
"""

import os

import pytest
import torch

from kdamoe.kernels import add_rms_norm, gated_rms_norm, rms_norm
from kdamoe.model import kernel_dispatch
from kdamoe.model.modeling_kdamoe import KDAMoERMSNorm
from kdamoe.model.norm_torch import add_rms_norm_torch, gated_rms_norm_torch, rms_norm_torch

ON_GPU = bool(os.environ.get("KDAMOE_TEST_ON_GPU")) and torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # relative L2 against float64
EPS = 1e-6

# (x dtype, weight dtype, shape): same dtype, the promotion case (fp32 weight on low-precision x), odd widths,
# leading dims.
CASES = [(dt, dt, (5, 64)) for dt in DTYPES] + [(dt, torch.float32, (2, 3, 72)) for dt in DTYPES if dt != torch.float32]
CASES += [(torch.float32, torch.float32, (3, 1000)), (torch.float16, torch.float16, (2, 3, 1000)),
          (torch.float32, torch.float16, (4, 72))]


def rel(a, b):
    """Relative L2 error of a against the reference b (float64, on the CPU)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm()).item()


def make_inputs(x_dtype, w_dtype, shape, seed, gated):
    """x (with row 0 all zeros: only eps keeps it finite), weight near 1, gate logits, an upstream gradient."""
    gen = torch.Generator().manual_seed(seed)
    x = 2 * torch.randn(shape, generator=gen)
    x.view(-1, shape[-1])[0] = 0
    w = 1 + 0.5 * torch.randn(shape[-1], generator=gen)
    gate = 2 * torch.randn(shape, generator=gen) if gated else None
    dout = torch.randn(shape, generator=gen)

    def cast(t, dt):
        return None if t is None else t.to(DEVICE, dt).requires_grad_()

    return cast(x, x_dtype), cast(w, w_dtype), cast(gate, x_dtype), dout.to(DEVICE)


def float64_reference(x, w, gate, dout):
    """The formula in float64 (no intermediate rounding) and its autograd gradients (x, w[, gate])."""
    leaves = [t.detach().double().requires_grad_() for t in (x, w, gate) if t is not None]
    xd, wd = leaves[0], leaves[1]
    out = wd * (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS))
    if gate is not None:
        out = out * torch.sigmoid(leaves[2])
    return out, torch.autograd.grad(out, leaves, dout.double())


def run(fn, args, dout):
    out = fn(*args, EPS)
    return out, torch.autograd.grad(out, [a for a in args], dout.to(out.dtype))


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("x_dtype, w_dtype, shape", CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_norm_matches_float64_autograd_and_torch_op(x_dtype, w_dtype, shape, gated):
    x, w, gate, dout = make_inputs(x_dtype, w_dtype, shape, seed=sum(shape) + gated, gated=gated)
    args = (x, gate, w) if gated else (x, w)
    kernel, reference = (gated_rms_norm, gated_rms_norm_torch) if gated else (rms_norm, rms_norm_torch)
    out, grads = run(kernel, args, dout)
    same_out, same_grads = run(reference, args, dout)
    out64, grads64 = float64_reference(x, w, gate, dout)

    expected_dtype = x_dtype if gated else torch.promote_types(x_dtype, w_dtype)
    assert out.dtype == same_out.dtype == expected_dtype and out.shape == x.shape
    assert [g.dtype for g in grads] == [a.dtype for a in args]
    torch.testing.assert_close(out, same_out)  # the same rounding points: equal to one rounding of the dtype
    assert torch.all(out.view(-1, shape[-1])[0] == 0)  # the zero row stays zero
    tol = max(TOL[x_dtype], TOL[w_dtype])  # the coarser dtype rounds the output or the weight gradient
    assert rel(out, out64) < tol
    # grads64 is ordered (x, w, gate); args is (x, gate, w) for the gated op.
    order = (0, 2, 1) if gated else (0, 1)
    for name, g, g_same, i in zip(("x", "gate", "w") if gated else ("x", "w"), grads, same_grads, order, strict=True):
        assert rel(g, grads64[i]) < tol, name
        assert rel(g, g_same) < tol, name


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_strided_inputs_give_the_contiguous_result(gated):
    """Rows read through a row stride (a slice of a wider tensor) and a gate and upstream gradient whose last dim
    is not unit-stride (copied) give bitwise the results of contiguous copies."""
    gen = torch.Generator().manual_seed(7)
    wide = torch.randn(6, 40, generator=gen).to(DEVICE)
    x = wide[:, :24].unflatten(0, (2, 3))  # [2, 3, 24], row stride 40
    gate = torch.randn(24, 6, generator=gen).to(DEVICE).t().unflatten(0, (2, 3))  # last-dim stride 6
    w = (1 + 0.5 * torch.randn(24, generator=gen)).to(DEVICE)
    dout = torch.randn(24, 6, generator=gen).to(DEVICE).t().unflatten(0, (2, 3))
    results = []
    for args in ((x, gate, w), (x.contiguous(), gate.contiguous(), w)):
        args = [a.detach().requires_grad_() for a in (args if gated else (args[0], args[2]))]
        out = (gated_rms_norm if gated else rms_norm)(*args, EPS)
        results.append([out, *torch.autograd.grad(out, args, dout.contiguous() if results else dout)])
    for strided, contiguous in zip(*results, strict=True):
        assert torch.equal(strided, contiguous)


def test_many_rows_sum_the_weight_gradient_over_all_programs():
    """More row blocks than backward programs (each program loops over several blocks): dw is the full sum."""
    x, w, _, dout = make_inputs(torch.float32, torch.float32, (300, 16), seed=3, gated=False)
    out, (dx, dw) = run(rms_norm, (x, w), dout)
    _, (dx64, dw64) = float64_reference(x, w, None, dout)
    assert rel(dw, dw64) < 1e-5 and rel(dx, dx64) < 1e-5


def test_empty_input():
    x = torch.zeros(0, 3, 8, device=DEVICE, requires_grad=True)
    w = torch.ones(8, device=DEVICE, requires_grad=True)
    out = rms_norm(x, w, EPS)
    dx, dw = torch.autograd.grad(out.sum(), (x, w))
    assert out.shape == (0, 3, 8) and dx.shape == x.shape and torch.equal(dw, torch.zeros_like(w))


# (x dtype, residual dtype, weight dtype, shape): one dtype throughout, a float32 stream with a low-precision branch
# output (autocast), a low-precision stream with a float32 weight, odd widths, leading dims, many row blocks.
ADD_CASES = [(dt, dt, dt, (5, 64)) for dt in DTYPES]
ADD_CASES += [(dt, torch.float32, torch.float32, (2, 3, 72)) for dt in DTYPES if dt != torch.float32]
ADD_CASES += [(dt, dt, torch.float32, (3, 1000)) for dt in DTYPES if dt != torch.float32]
ADD_CASES += [(torch.float32, torch.float32, torch.float32, (300, 16))]


@pytest.mark.parametrize("x_dtype, r_dtype, w_dtype, shape", ADD_CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_add_rms_norm_matches_float64_autograd_and_the_unfused_ops(x_dtype, r_dtype, w_dtype, shape):
    """``(h, out) = add_rms_norm(x, residual, w)`` with gradients flowing into both outputs (h continues the residual
    stream). Forward: h equals the torch add to the bit, out ``rms_norm_torch(h)`` as the plain kernel does (the same
    rounding points), and both match float64. Gradients of x, residual and w: against float64 autograd of
    ``h = x + r, out = norm(h)``, and against the unfused ops within one rounding of the dtype (the kernel adds h's
    gradient before rounding)."""
    gen = torch.Generator().manual_seed(sum(shape) + 11)
    x = 2 * torch.randn(shape, generator=gen)
    r = torch.randn(shape, generator=gen)
    w = 1 + 0.5 * torch.randn(shape[-1], generator=gen)
    dh, dout = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    args = [x.to(DEVICE, x_dtype).requires_grad_(), r.to(DEVICE, r_dtype).requires_grad_(),
            w.to(DEVICE, w_dtype).requires_grad_()]

    def grads(fn):
        h, out = fn(*args, EPS)
        g = torch.autograd.grad((h, out), args, (dh.to(DEVICE, h.dtype), dout.to(DEVICE, out.dtype)))
        return h, out, g

    h, out, g = grads(add_rms_norm)
    h_same, out_same, g_same = grads(add_rms_norm_torch)
    h_dtype = torch.promote_types(x_dtype, r_dtype)
    assert h.dtype == h_dtype and out.dtype == torch.promote_types(h_dtype, w_dtype) and out.shape == x.shape
    assert torch.equal(h, h_same)
    torch.testing.assert_close(out, out_same)  # rms_norm's own agreement: the same rounding points
    assert [t.dtype for t in g] == [a.dtype for a in args]

    leaves = [a.detach().cpu().double().requires_grad_() for a in args]
    h64 = leaves[0] + leaves[1]
    out64 = leaves[2] * (h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + EPS))
    g64 = torch.autograd.grad((h64, out64), leaves, (dh.double(), dout.double()))
    tol = max(TOL[x_dtype], TOL[r_dtype], TOL[w_dtype])
    assert rel(out, out64) < tol
    for name, got, same, want in zip(("x", "residual", "weight"), g, g_same, g64, strict=True):
        assert rel(got, want) < tol, name
        assert rel(got, same) < tol, name


def test_add_rms_norm_with_an_unused_output_and_in_the_module():
    """Only ``out`` takes a gradient: the norm's gradient alone; only ``h``: the add's, and the weight none.
    ``KDAMoERMSNorm`` with a ``residual`` runs the fused op and returns ``(h, out)``; without one, the plain norm."""
    gen = torch.Generator().manual_seed(3)
    x, r = torch.randn(4, 32, generator=gen).to(DEVICE), torch.randn(4, 32, generator=gen).to(DEVICE)
    w = (1 + 0.5 * torch.randn(32, generator=gen)).to(DEVICE)
    dout = torch.randn(4, 32, generator=gen).to(DEVICE)
    args = [t.clone().requires_grad_() for t in (x, r, w)]
    _, out = add_rms_norm(*args, EPS)
    got = torch.autograd.grad(out, args, dout)
    ref = [t.clone().requires_grad_() for t in (x, r, w)]
    want = torch.autograd.grad(rms_norm_torch(ref[0] + ref[1], ref[2], EPS), ref, dout)
    for name, a, b in zip(("x", "residual", "weight"), got, want, strict=True):
        assert rel(a, b) < 1e-5, name
    # only h used: the add's gradient alone, and no weight gradient (as the unfused ops give: the norm is unused)
    args = [t.clone().requires_grad_() for t in (x, r, w)]
    h, _ = add_rms_norm(*args, EPS)
    h.backward(dout)
    assert torch.equal(args[0].grad, dout) and torch.equal(args[1].grad, dout) and args[2].grad is None
    norm = KDAMoERMSNorm(32, eps=EPS).to(DEVICE)
    norm.config = type("C", (), {"kernel_backend": "triton"})()
    h, out = norm(x, r)
    assert torch.equal(h, x + r) and torch.equal(out, rms_norm(x + r, norm.weight, EPS))  # the same kernel math
    assert torch.equal(norm(x), rms_norm(x, norm.weight, EPS))


def test_bad_arguments_raise_value_errors_naming_them():
    x = torch.randn(2, 8, device=DEVICE)
    w = torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match=r"weight must be \[D\] = \(8,\)"):
        rms_norm(x, torch.ones(7, device=DEVICE), EPS)
    with pytest.raises(ValueError, match="gate must have x's shape"):
        gated_rms_norm(x, torch.randn(2, 4, device=DEVICE), w, EPS)
    for fn in (add_rms_norm, add_rms_norm_torch):
        with pytest.raises(ValueError, match=r"residual must have x's shape \(2, 8\), got \(1, 8\)"):
            fn(x, torch.randn(1, 8, device=DEVICE), w, EPS)  # no broadcasting
        with pytest.raises(ValueError, match="residual dtype"):
            fn(x, x.int(), w, EPS)
        with pytest.raises(ValueError, match="residual must be a torch.Tensor"):
            fn(x, None, w, EPS)
    for backend in ("torch", "triton"):
        with pytest.raises(ValueError, match="residual must be a torch.Tensor"):
            kernel_dispatch.add_rms_norm(x, None, w, EPS, backend=backend)
        with pytest.raises(ValueError, match="x must be a torch.Tensor"):
            kernel_dispatch.add_rms_norm([1.0] * 8, x, w, EPS, backend=backend)
    with pytest.raises(ValueError, match="x dtype"):
        rms_norm(x.long(), w, EPS)
    with pytest.raises(ValueError, match="x dtype"):
        rms_norm(x.double(), w, EPS)  # the torch op takes float64, the kernel does not
    with pytest.raises(ValueError, match="gate dtype"):
        gated_rms_norm(x, x.int(), w, EPS)
    with pytest.raises(ValueError, match="weight is on meta"):
        rms_norm(x, torch.ones(8, device="meta"), EPS)
    with pytest.raises(ValueError, match="D = 8193 exceeds"):
        rms_norm(torch.randn(1, 8193, device=DEVICE), torch.ones(8193, device=DEVICE), EPS)
    with pytest.raises(ValueError, match="eps must be a float >= 0, got -1.0"):
        rms_norm(x, w, -1.0)
    with pytest.raises(ValueError, match="weight must be a torch.Tensor"):
        rms_norm_torch(x, [1.0] * 8, EPS)


def test_dispatch_picks_the_kernel_or_the_torch_op(monkeypatch):
    """``kernel_dispatch.rms_norm`` / ``gated_rms_norm`` run the kdamoe kernels with backend="triton" (CPU under
    the interpreter) and the torch ops with "torch"; a module built without a config uses "auto"."""
    calls = []
    kernels = kernel_dispatch.kdamoe_kernels()
    for name in ("rms_norm", "gated_rms_norm"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    x, w, gate, _ = make_inputs(torch.float32, torch.float32, (3, 16), seed=5, gated=True)
    for backend in ("torch", "triton"):
        plain = kernel_dispatch.rms_norm(x, w, EPS, backend=backend)
        gated = kernel_dispatch.gated_rms_norm(x, gate, w, EPS, backend=backend)
        torch.testing.assert_close(plain, rms_norm_torch(x, w, EPS))
        torch.testing.assert_close(gated, gated_rms_norm_torch(x, gate, w, EPS))
    assert calls == ["rms_norm", "gated_rms_norm"]  # only the "triton" round reached the kernels
    module = KDAMoERMSNorm(16, eps=EPS).to(DEVICE)
    assert module.kernel_backend == "auto"
    torch.testing.assert_close(module(x), rms_norm_torch(x, module.weight, EPS))
