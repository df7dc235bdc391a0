"""Element-wise GLU activation of two separate branches in one Triton kernel (forward) and one (backward).

The dense MLP and the shared experts compute ``act(gate_proj(x), up_proj(x))``; in PyTorch SiTU-GLU is about
ten element-wise kernels per call (divisions, tanh, sigmoid, products, dtype casts), which dominates a
decode step by launch count. Here one kernel reads ``gate`` and ``up`` and writes the output; the backward
recomputes the activation from the saved inputs and writes both input gradients in one more kernel.

Formulas (``activation.py``, shared with the experts' GEMM epilogue; fp32 inside):

* SiTU-GLU [Kimi K3 report §2.3]: ``out = β1·tanh(a/β1)·σ(a) · β2·tanh(b/β2)`` (``β1 = 4``, ``β2 = 25`` by default);
* SwiGLU [Shazeer 2020, arXiv:2002.05202]: ``out = a·σ(a) · b``.

Reference semantics are ``kdamoe.model.moe_torch.GLUActivation``. For SiTU it also computes in float32 and rounds
once to the input dtype, so the two agree to float32 rounding. For SwiGLU, PyTorch's ``F.silu(gate) * up``
rounds ``silu(gate)`` to the input dtype before the product (and likewise in its backward); the kernel rounds
only the final values, so in float16 / bfloat16 it is the more accurate of the two (tests compare both with a
float64 reference).
"""

import math

import torch
import triton
import triton.language as tl

from ..launch import fast_launch
from ..utils import cdiv, is_interpreter
from .activation import ACTIVATIONS, glu_backward, glu_forward

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
# 2048 elements per program, 8 warps: 8 contiguous elements per thread (16-byte loads in 16-bit dtypes). A
# fixed config, not autotuned, so that the first call inside a CUDA-graph capture does not time anything.
BLOCK = 2048
NUM_WARPS = 8


@fast_launch
@triton.jit
def _glu_fwd_kernel(gate, up, out, n, width, stride_gate, stride_up, beta1, beta2, ACT: tl.constexpr,
                    BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: more than 2^31 elements is possible
    mask = offs < n
    row, col = offs // width, offs % width  # the inputs may be column slices of one GEMM output (row strides)
    a = tl.load(gate + row * stride_gate + col, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(up + row * stride_up + col, mask=mask, other=0.0).to(tl.float32)
    y = glu_forward(a, b, ACT, beta1, beta2)
    tl.store(out + offs, y.to(out.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def _glu_bwd_kernel(gate, up, dout, dgate, dup, n, width, stride_gate, stride_up, beta1, beta2, ACT: tl.constexpr,
                    BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    row, col = offs // width, offs % width
    a = tl.load(gate + row * stride_gate + col, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(up + row * stride_up + col, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dout + offs, mask=mask, other=0.0).to(tl.float32)
    _, da, db = glu_backward(a, b, dy, ACT, beta1, beta2)
    tl.store(dgate + offs, da.to(dgate.dtype.element_ty), mask=mask)
    tl.store(dup + offs, db.to(dup.dtype.element_ty), mask=mask)


def _grid(n: int):
    return (cdiv(n, BLOCK),)


class GLUFunction(torch.autograd.Function):
    """Autograd over 2-D ``gate`` / ``up`` ``[rows, I]`` of one shape and dtype, each with unit column stride (any
    row stride); see :func:`glu`. Saves only the two inputs (the PyTorch chain saves its float32 intermediates)."""

    @staticmethod
    def forward(ctx, gate, up, act, beta1, beta2):
        out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        n = gate.numel()
        if n > 0:
            _glu_fwd_kernel[_grid(n)](gate, up, out, n, gate.shape[1], gate.stride(0), up.stride(0), beta1, beta2,
                                      ACT=act, BLOCK=BLOCK, num_warps=NUM_WARPS)
        ctx.save_for_backward(gate, up)
        ctx.act, ctx.betas = act, (beta1, beta2)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        dout = dout.to(gate.dtype).contiguous()
        dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        dup = torch.empty(up.shape, dtype=up.dtype, device=up.device)
        n = gate.numel()
        if n > 0:
            _glu_bwd_kernel[_grid(n)](gate, up, dout, dgate, dup, n, gate.shape[1], gate.stride(0), up.stride(0),
                                      *ctx.betas, ACT=ctx.act, BLOCK=BLOCK, num_warps=NUM_WARPS)
        return dgate, dup, None, None, None


def _validate(gate, up, activation, beta1, beta2):
    """Raise ValueError for anything the kernel cannot run correctly (before any launch)."""
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"glu: {name} must be a torch.Tensor, got {type(t).__name__}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"glu: activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    if gate.shape != up.shape:
        raise ValueError(f"glu: gate and up must have one shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    if gate.dtype != up.dtype:
        raise ValueError(f"glu: gate and up must have one dtype, got {gate.dtype} and {up.dtype}")
    if gate.dtype not in _FLOATS:
        raise ValueError(f"glu: dtype must be float16, bfloat16 or float32, got {gate.dtype}")
    if gate.device != up.device:
        raise ValueError(f"glu: gate and up must be on one device, got {gate.device} and {up.device}")
    if gate.device.type != "cuda" and not (gate.device.type == "cpu" and is_interpreter()):
        raise ValueError(f"glu: gate is on {gate.device}; the Triton kernel needs CUDA tensors "
                         f"(or CPU with TRITON_INTERPRET=1)")
    if activation == "situ":
        for name, beta in (("beta1", beta1), ("beta2", beta2)):
            if not isinstance(beta, (int, float)) or isinstance(beta, bool) or not math.isfinite(beta) or beta <= 0:
                raise ValueError(f"glu: {name} must be a finite number > 0 for SiTU-GLU, got {beta!r}")


def glu(gate: torch.Tensor, up: torch.Tensor, activation: str = "situ", beta1: float = 4.0,
        beta2: float = 25.0) -> torch.Tensor:
    """Fused GLU activation ``act(gate, up)``, differentiable in both inputs.

    Args:
        gate: ``[*, I]`` gate branch (e.g. ``gate_proj(x)``), float16 / bfloat16 / float32, on CUDA (or CPU
            under ``TRITON_INTERPRET=1``). Any leading dims; a column slice (row stride ≠ I, e.g. of a
            fused gate|up GEMM output) is read in place, other layouts are copied first.
        up: the linear branch, same shape, dtype and device as ``gate``.
        activation: ``"situ"`` (SiTU-GLU) or ``"silu"`` (SwiGLU).
        beta1, beta2: SiTU-GLU's soft caps of the gate and linear branches (``config.situ_beta`` /
            ``config.situ_linear_beta``); ignored by ``"silu"``.

    Returns:
        ``[*, I]`` in the input dtype: SiTU ``β1·tanh(a/β1)·σ(a)·β2·tanh(b/β2)`` or SwiGLU ``a·σ(a)·b``, computed
        in float32 and rounded once. The backward returns ``d_gate``, ``d_up`` in the input dtype (float32
        inside). No host synchronisation (CUDA-graph capturable).

    Raises:
        ValueError: a non-tensor input, shapes / dtypes / devices that differ, a dtype other than float16 /
            bfloat16 / float32, a device the kernel cannot run on, an unknown ``activation``, or (SiTU) a beta
            that is not a finite number > 0.
    """
    _validate(gate, up, activation, beta1, beta2)
    betas = (float(beta1), float(beta2)) if activation == "situ" else (1.0, 1.0)  # SwiGLU reads no beta
    width = gate.shape[-1] if gate.dim() else 1
    out = GLUFunction.apply(_rows(gate, width), _rows(up, width), ACTIVATIONS[activation], *betas)
    return out.view(gate.shape)


def _rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` as ``[rows, width]`` with unit column stride: a view when the leading dims merge (a column slice of a
    fused gate|up GEMM output does, with row stride 2I), else a contiguous copy."""
    rows = math.prod(x.shape[:-1]) if x.dim() else 1
    if x.dim() == 0 or x.stride(-1) == 1:
        try:
            return x.view(rows, width)
        except RuntimeError:  # leading dims that do not merge into one stride
            pass
    return x.contiguous().view(rows, width)
