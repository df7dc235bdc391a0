"""RMSNorm, gated RMSNorm and residual add + RMSNorm in Triton: public functions and their autograd Functions.

Semantics are those of ``kdamoe.model.norm_torch`` (``rms_norm_torch`` / ``gated_rms_norm_torch``, the references),
including the dtypes and rounding points; the launches are in ``forward.py`` and ``backward.py``. Any leading dims
are flattened to rows (a view where possible: a row stride is passed to the kernels, only the last dim must be
unit-stride).
"""

import torch
from torch.autograd.function import once_differentiable

from ..utils import is_interpreter
from .backward import norm_backward
from .forward import MAX_D, norm_forward

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


# The op's own argument checks (the same rules as the PyTorch reference in kdamoe/model/, which keeps its own
# copy: the model folder loads without kdamoe.kernels, and the kernels import nothing but torch and triton).
def check_norm_args(x, weight, eps, gate=None, floats=_FLOATS, gate_name="gate") -> None:
    """Shape / dtype / device checks shared by the norm ops (no value is read: no host sync). ``gate`` is any second
    input of x's shape, named ``gate_name`` in the errors (the gated norm's gate, the add + norm's residual).

    Raises:
        ValueError: naming the bad argument: a non-tensor, ``x`` without a last dim, ``weight`` not ``[D]``
            with ``D = x.shape[-1]``, ``gate`` not of x's shape, a dtype outside ``floats``, a tensor on
            another device than x, or ``eps`` not a non-negative float.
    """
    named = (("x", x), ("weight", weight)) + (((gate_name, gate),) if gate is not None else ())
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"x must be [..., D] with D >= 1, got shape {tuple(x.shape)}")
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"weight must be [D] = ({D},) like x's last dim, got shape {tuple(weight.shape)}")
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"{gate_name} must have x's shape {tuple(x.shape)}, got {tuple(gate.shape)}")
    for name, t in named:
        if t.dtype not in floats:
            raise ValueError(f"{name} dtype must be one of {floats}, got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, expected {x.device} like x")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a float >= 0, got {eps!r}")


def check_add_norm_args(x, residual, weight, eps, floats=_FLOATS) -> None:
    """:func:`check_norm_args` for the residual add + norm: ``residual`` is required (a tensor of x's shape).

    Raises:
        ValueError: a residual that is not a tensor, or anything :func:`check_norm_args` refuses.
    """
    if not isinstance(residual, torch.Tensor):
        raise ValueError(f"residual must be a torch.Tensor of x's shape, got {type(residual).__name__}")
    check_norm_args(x, weight, eps, residual, floats=floats, gate_name="residual")



def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, D]`` with a unit last stride (a view when the layout allows it)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 or t2.shape[-1] == 1 else t2.contiguous()


def _validate(x, weight, eps, gate=None):
    check_norm_args(x, weight, eps, gate, floats=_FLOATS)
    if x.shape[-1] > MAX_D:
        raise ValueError(f"x's last dim D = {x.shape[-1]} exceeds the kernels' maximum {MAX_D}")
    if x.device.type != "cuda" and not (x.device.type == "cpu" and is_interpreter()):
        raise ValueError(f"x is on {x.device}: the Triton kernels need a CUDA tensor (or CPU with TRITON_INTERPRET=1)")


class RMSNormFunction(torch.autograd.Function):
    """Autograd of :func:`rms_norm`: differentiable in x and weight."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        x2, weight = _rows(x), weight.contiguous()
        out_dtype = torch.promote_types(x.dtype, weight.dtype)
        ctx.save_for_backward(x2, weight)
        ctx.eps, ctx.n_dtype, ctx.shape = eps, out_dtype, x.shape
        return norm_forward(x2, None, weight, eps, out_dtype, out_dtype).view(x.shape)

    @staticmethod
    @once_differentiable  # the backward is a kernel: a double backward raises instead of treating it as constant
    def backward(ctx, dout):
        x2, weight = ctx.saved_tensors
        dx, _, dw = norm_backward(x2, None, weight, _rows(dout), ctx.eps, ctx.n_dtype)
        return dx.view(ctx.shape), dw.to(weight.dtype), None


class GatedRMSNormFunction(torch.autograd.Function):
    """Autograd of :func:`gated_rms_norm`: differentiable in x, gate and weight."""

    @staticmethod
    def forward(ctx, x, gate, weight, eps):
        x2, gate2, weight = _rows(x), _rows(gate), weight.contiguous()
        n_dtype = torch.promote_types(x.dtype, weight.dtype)
        ctx.save_for_backward(x2, gate2, weight)
        ctx.eps, ctx.n_dtype, ctx.shape = eps, n_dtype, x.shape
        return norm_forward(x2, gate2, weight, eps, x.dtype, n_dtype).view(x.shape)

    @staticmethod
    @once_differentiable  # the backward is a kernel: a double backward raises instead of treating it as constant
    def backward(ctx, dout):
        x2, gate2, weight = ctx.saved_tensors
        dx, dgate, dw = norm_backward(x2, gate2, weight, _rows(dout), ctx.eps, ctx.n_dtype)
        return dx.view(ctx.shape), dgate.view(ctx.shape), dw.to(weight.dtype), None


class AddRMSNormFunction(torch.autograd.Function):
    """Autograd of :func:`add_rms_norm`: returns ``(h, out)``; differentiable in x, residual and weight."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        x2, r2, weight = _rows(x), _rows(residual), weight.contiguous()
        h_dtype = torch.promote_types(x.dtype, residual.dtype)
        out_dtype = torch.promote_types(h_dtype, weight.dtype)
        out, h2 = norm_forward(x2, None, weight, eps, out_dtype, out_dtype, residual2=r2, h_dtype=h_dtype)
        ctx.save_for_backward(h2, weight)
        ctx.eps, ctx.n_dtype, ctx.shape, ctx.dtypes = eps, out_dtype, x.shape, (x.dtype, residual.dtype)
        ctx.set_materialize_grads(False)  # an output nobody used has no gradient: no zeros to read, dw stays None
        return h2.view(x.shape), out.view(x.shape)

    @staticmethod
    @once_differentiable  # the backward is a kernel: a double backward raises instead of treating it as constant
    def backward(ctx, dh, dout):
        h2, weight = ctx.saved_tensors
        dw = None
        if dout is None:  # only h was used: the add's gradient alone
            dx = dh.to(h2.dtype).reshape(ctx.shape)
        else:
            dx, _, dw = norm_backward(h2, None, weight, _rows(dout), ctx.eps, ctx.n_dtype,
                                      dres2=_rows(dh) if dh is not None else None)
            dx, dw = dx.view(ctx.shape), dw.to(weight.dtype)
        return dx.to(ctx.dtypes[0]), dx.to(ctx.dtypes[1]), dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    r"""RMSNorm over the last dim (Zhang & Sennrich 2019), one kernel forward and one backward; differentiable.

    ``weight · cast_x(x̂ · rsqrt(mean(x̂²) + eps))`` with ``x̂ = float32(x)``: the result of
    :func:`kdamoe.model.norm_torch.rms_norm_torch` with the same dtype and rounding points (float32 sums; the
    weight gradient is summed over rows in float32, deterministically).

    Args:
        x: ``[..., D]`` float16 / bfloat16 / float32, 1 ≤ D ≤ 8192; its last dim must be unit-stride or it is
            copied.
        weight: ``[D]`` float16 / bfloat16 / float32 (may differ from x's dtype).
        eps: added to the mean square (≥ 0).

    Returns:
        ``[..., D]`` in ``torch.promote_types(x.dtype, weight.dtype)``.

    Raises:
        ValueError: bad shapes, dtypes, devices or eps (see :func:`check_norm_args`),
            ``D > 8192``, or a device the kernels cannot run on.
    """
    _validate(x, weight, eps)
    return RMSNormFunction.apply(x, weight, float(eps))


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    r"""``cast_x(float32(rms_norm(x, weight, eps)) · σ(float32(gate)))`` in one kernel forward and one
    backward: the KDA output norm and sigmoid gate (Kimi Linear report §3); differentiable in all three.

    Same results as :func:`kdamoe.model.norm_torch.gated_rms_norm_torch`.

    Args:
        x: ``[..., D]`` float16 / bfloat16 / float32, 1 ≤ D ≤ 8192.
        gate: gate logits of x's shape, float16 / bfloat16 / float32.
        weight: ``[D]`` float16 / bfloat16 / float32.
        eps: added to the mean square (≥ 0).

    Returns:
        ``[..., D]`` in x's dtype.

    Raises:
        ValueError: as :func:`rms_norm`, and a gate of another shape than x.
    """
    _validate(x, weight, eps, gate)
    return GatedRMSNormFunction.apply(x, gate, weight, float(eps))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    r"""The residual add and the next pre-norm in one kernel forward and one backward: ``h = x + residual``,
    ``out = rms_norm(h, weight, eps)``; differentiable in all three.

    A decoder layer's ``h = h + mixer(norm1(h))`` followed by ``norm2(h)``: fused, the forward reads x and residual
    once and writes h and out (the add kernel's separate pass over h is gone), and the backward adds h's own gradient
    (from the rest of the residual stream) to the norm's input gradient in float32 before one rounding, where
    autograd of the two ops rounds the norm's gradient to h's dtype and then adds in a kernel of its own. Forward, h is
    torch's add to the bit and out is :func:`rms_norm` of h; the gradients differ from the unfused ops' by that one
    rounding.

    Args:
        x, residual: ``[..., D]`` of the same shape, float16 / bfloat16 / float32 (their dtypes may differ: h is in
            ``torch.promote_types`` of the two, as torch's add gives), 1 ≤ D ≤ 8192.
        weight: ``[D]`` float16 / bfloat16 / float32.
        eps: added to the mean square (≥ 0).

    Returns:
        ``(h [..., D] in promote(x, residual), out [..., D] in promote(h, weight))``.

    Raises:
        ValueError: as :func:`rms_norm`, and a residual that is not a float tensor of x's shape on x's device.
    """
    check_add_norm_args(x, residual, weight, eps, floats=_FLOATS)
    _validate(x, weight, eps)  # the kernels' own limits (D, device)
    return AddRMSNormFunction.apply(x, residual, weight, float(eps))
