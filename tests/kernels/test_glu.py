"""The fused GLU kernel ``kdamoe.kernels.glu`` (SiTU-GLU and SwiGLU, forward and backward) against a float64
autograd reference of the formulas written out here, its argument errors, the dispatch
``kernel_dispatch.glu_activation`` and the model's ``KDAMoEMLP`` on both backends.

Runs on the CPU interpreter (tests/conftest.py) in float32 and float16; with KDAMOE_TEST_ON_GPU=1 on a CUDA
machine the same tests run on the GPU, plus bfloat16. The model-level parity (a tiny KDAMoE model, "triton"
against "torch", logits and every gradient) is tests/test_model_triton.py's training-step test: its config has a
dense first layer and a shared expert, so both KDAMoEMLP uses go through this kernel there (SiTU-GLU).
"""

import os

import pytest
import torch

import kdamoe.model.kernel_dispatch as dispatch
from kdamoe.kernels import glu
from kdamoe.kernels.moe.glu import _rows
from kdamoe.model.modeling_kdamoe import KDAMoEMLP
from tests.helpers import tiny_config

ON_GPU = bool(os.environ.get("KDAMOE_TEST_ON_GPU")) and torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])  # the interpreter mishandles bf16
# relative L2 / max-abs error (relative to max |ref|) against float64: a few roundings of the input dtype
TOL = {torch.float32: 5e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
ACTS = [("situ", 4.0, 25.0), ("situ", 1.5, 3.0), ("situ", 10.0, 0.5), ("silu", None, None)]


def reference(a, b, activation, beta1, beta2):
    """The formulas in float64 (Kimi K3 report §2.3 for SiTU-GLU; SwiGLU ``a·σ(a)·b``)."""
    if activation == "situ":
        return beta1 * torch.tanh(a / beta1) * torch.sigmoid(a) * (beta2 * torch.tanh(b / beta2))
    return a * torch.sigmoid(a) * b


def inputs(shape, dtype, seed, scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    gate, up, dout = (scale * torch.randn(shape, generator=gen) for _ in range(3))
    return gate.to(DEVICE, dtype), up.to(DEVICE, dtype), dout.to(DEVICE, dtype)


def kernel_and_reference(gate, up, dout, activation, beta1, beta2):
    """``(out, d_gate, d_up)`` of the kernel and of the float64 reference on the same (rounded) inputs."""
    g, u = gate.detach().requires_grad_(), up.detach().requires_grad_()
    out = glu(g, u, activation, beta1, beta2)
    out.backward(dout)
    g64, u64 = (t.detach().double().cpu().requires_grad_() for t in (gate, up))
    ref = reference(g64, u64, activation, beta1, beta2)
    ref.backward(dout.double().cpu())
    return (out, g.grad, u.grad), (ref.detach(), g64.grad, u64.grad)


def assert_matches(got, want, dtype):
    for name, a, b in zip(("out", "d_gate", "d_up"), got, want, strict=True):
        assert a.dtype == dtype and a.shape == b.shape, name
        a = a.detach().double().cpu()
        assert torch.isfinite(a).all(), name
        scale = b.abs().max().clamp(min=1e-30)
        assert ((a - b).norm() / b.norm().clamp(min=1e-30)).item() <= TOL[dtype], name
        assert ((a - b).abs().max() / scale).item() <= TOL[dtype], name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation,beta1,beta2", ACTS)
def test_forward_backward_match_float64_reference(dtype, activation, beta1, beta2):
    gate, up, dout = inputs((3, 5, 777), dtype, seed=1)  # 11 655 elements: the last block is partial
    got, want = kernel_and_reference(gate, up, dout, activation, beta1, beta2)
    assert_matches(got, want, dtype)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the interpreter's exp(±inf)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation,beta1,beta2", ACTS[:1] + ACTS[-1:])
def test_large_inputs_saturate_without_nan(dtype, activation, beta1, beta2):
    """|x| up to 200: exp overflows to inf in tanh and sigmoid, which must give ±1 / 0, never inf·0 = NaN."""
    gen = torch.Generator().manual_seed(2)
    gate, up = (torch.empty(4099).uniform_(-200, 200, generator=gen) for _ in range(2))
    gate[:4], up[:4] = torch.tensor([200.0, -200.0, 200.0, -200.0]), torch.tensor([200.0, 200.0, -200.0, -200.0])
    dout = torch.randn(4099, generator=gen)
    gate, up, dout = (t.to(DEVICE, dtype) for t in (gate, up, dout))
    got, want = kernel_and_reference(gate, up, dout, activation, beta1, beta2)
    assert_matches(got, want, dtype)
    if activation == "situ":  # the soft caps hold: |out| <= β1·β2
        assert got[0].abs().max().item() <= beta1 * beta2


@pytest.mark.parametrize("shape", [(1,), (4097,), (2, 3, 4, 65), (7, 1, 1)])
def test_odd_sizes_and_leading_dims(shape):
    gate, up, dout = inputs(shape, torch.float32, seed=3)
    got, want = kernel_and_reference(gate, up, dout, "situ", 4.0, 25.0)
    assert_matches(got, want, torch.float32)


def test_empty_input_gives_empty_output_and_gradients():
    gate = torch.empty(0, 16, device=DEVICE, requires_grad=True)
    up = torch.empty(0, 16, device=DEVICE, requires_grad=True)
    out = glu(gate, up, "silu")
    out.sum().backward()
    assert out.shape == (0, 16) and gate.grad.shape == (0, 16) and up.grad.shape == (0, 16)


def test_non_contiguous_inputs():
    gate_t, up_t, dout = inputs((96, 40), torch.float32, seed=4)
    gate, up = gate_t.t(), up_t.t()  # [40, 96] views with strides (1, 40)
    assert not gate.is_contiguous()
    got, want = kernel_and_reference(gate, up, dout.t(), "situ", 4.0, 25.0)
    assert_matches(got, want, torch.float32)


def test_bad_arguments_raise_value_errors_naming_the_values():
    gate = torch.zeros(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"\(4, 8\) and \(4, 9\)"):
        glu(gate, torch.zeros(4, 9, device=DEVICE))
    with pytest.raises(ValueError, match="torch.float32 and torch.float16"):
        glu(gate, gate.half())
    with pytest.raises(ValueError, match="torch.float64"):
        glu(gate.double(), gate.double())
    with pytest.raises(ValueError, match="'gelu'"):
        glu(gate, gate, "gelu")
    with pytest.raises(ValueError, match="beta1 .* got 0.0"):
        glu(gate, gate, "situ", 0.0, 25.0)
    with pytest.raises(ValueError, match="beta2 .* got nan"):
        glu(gate, gate, "situ", 4.0, float("nan"))
    with pytest.raises(ValueError, match="up must be a torch.Tensor, got list"):
        glu(gate, [0.0])
    with pytest.raises(ValueError, match="meta"):
        glu(gate, torch.zeros(4, 8, device="meta"))


class CountingKernels:
    """``kdamoe.kernels`` with its ``glu`` wrapped to count calls (the dispatch reads no other attribute)."""

    def __init__(self):
        self.calls = 0

    def glu(self, *args):
        self.calls += 1
        return glu(*args)


@pytest.mark.parametrize("hidden_act", ["situ", "silu"])
def test_mlp_runs_the_kernel_for_the_backend_read_at_call_time(hidden_act, monkeypatch):
    """KDAMoEMLP on "triton" (kernel) and "torch" (GLUActivation): same output and gradients; the backend is
    switched on the config after the module is built."""
    kernels = CountingKernels()
    monkeypatch.setattr(dispatch, "kdamoe_kernels", lambda: kernels)
    config = tiny_config(hidden_act=hidden_act, situ_beta=2.0, situ_linear_beta=6.0)
    torch.manual_seed(5)
    mlp = KDAMoEMLP(config, 32, 48).to(DEVICE)
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    results = {}
    for backend in ("torch", "triton", "auto"):
        config.kernel_backend = backend
        mlp.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_()
        out = mlp(xg)
        (out * x).sum().backward()
        results[backend] = [out.detach(), xg.grad] + [p.grad for p in mlp.parameters()]
    assert kernels.calls == (2 if ON_GPU else 1)  # "auto" picks the kernel on CUDA only
    for got, want in zip(results["triton"], results["torch"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if not ON_GPU:
        for got, want in zip(results["auto"], results["torch"], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("activation", ["situ", "silu"])
def test_column_slices_of_one_gemm_output_are_read_in_place(activation):
    """``gate`` / ``up`` as the two halves of one ``[B, T, 2I]`` GEMM output (row stride 2I, what the MLP's fused
    projection hands over): same values and gradients as on contiguous copies, and no copy of the inputs."""
    gen = torch.Generator().manual_seed(11)
    both = torch.randn(2, 3, 2 * 37, generator=gen).to(DEVICE).requires_grad_()
    gate, up = both.split(37, dim=-1)
    out = glu(gate, up, activation)
    ref = glu(gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_(), activation)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    grad_out = torch.randn(out.shape, generator=gen).to(DEVICE)
    out.backward(grad_out)
    ref_gate, ref_up = (t.detach().double().requires_grad_() for t in (gate, up))
    reference(ref_gate, ref_up, activation, 4.0, 25.0).backward(grad_out.double())
    torch.testing.assert_close(both.grad, torch.cat([ref_gate.grad, ref_up.grad], -1).float(), rtol=1e-5, atol=1e-5)
    assert _rows(gate, 37).data_ptr() == gate.data_ptr() and _rows(gate, 37).stride(0) == 2 * 37
