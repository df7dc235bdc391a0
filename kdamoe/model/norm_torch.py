"""Pure-PyTorch RMSNorm, gated RMSNorm and residual add + RMSNorm: the CPU path of the model's norms and the reference
of the Triton kernels ``kdamoe.kernels.rms_norm`` / ``gated_rms_norm`` / ``add_rms_norm``.

RMSNorm (Zhang & Sennrich, "Root Mean Square Layer Normalization", 2019, eq. 4) over the last dim, computed in
float32 whatever the input dtype; the normalised value is rounded back to the input's dtype *before* the weight
multiplies it, and that product follows torch's type promotion (the Llama / transformers convention)::

    y   = x̂ · rsqrt(mean(x̂²) + eps)                x̂ = float32(x)
    out = weight · cast_x(y)                       dtype promote(x, weight): fp32 weight + bf16 x -> fp32

The gated variant is the KDA layer's output norm with its sigmoid output gate (Kimi Linear report §3;
docs/architecture.md §1): ``cast_x(float32(RMSNorm(x)) · σ(float32(gate)))``.

Remote-code rule (docs/architecture.md §7): this file is copied next to saved weights; it imports only torch.
"""

import torch

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


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


def _rms_norm(x, weight, eps):
    """The formula of :func:`rms_norm_torch` on checked arguments."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in float32, rounded to x's dtype, times ``weight`` (see the module docstring).

    Args:
        x: ``[..., D]`` float16 / bfloat16 / float32 / float64.
        weight: ``[D]`` float (its dtype may differ from x's).
        eps: added to the mean square (unitless, ≥ 0).

    Returns:
        ``[..., D]`` in ``torch.promote_types(x.dtype, weight.dtype)``.

    Raises:
        ValueError: see :func:`check_norm_args`.
    """
    check_norm_args(x, weight, eps)
    return _rms_norm(x, weight, eps)


def gated_rms_norm_torch(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``cast_x(float32(rms_norm_torch(x, weight, eps)) · σ(float32(gate)))``: the KDA output norm and gate.

    Args:
        x: ``[..., D]`` float (the per-head attention output, ``D`` = head dim).
        gate: gate logits of x's shape, any float dtype.
        weight: ``[D]`` float.
        eps: added to the mean square (≥ 0).

    Returns:
        ``[..., D]`` in x's dtype.

    Raises:
        ValueError: see :func:`check_norm_args`.
    """
    check_norm_args(x, weight, eps, gate)
    normed = _rms_norm(x, weight, eps)
    return (normed.float() * torch.sigmoid(gate.float())).to(x.dtype)


def add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """``h = x + residual`` and ``rms_norm_torch(h, weight, eps)``: a residual add and the pre-norm after it.

    Args:
        x, residual: ``[..., D]`` of the same shape, any float dtypes (h in their promoted dtype, torch's add).
        weight: ``[D]`` float.
        eps: added to the mean square (≥ 0).

    Returns:
        ``(h, out)``: h ``[..., D]`` in ``promote(x, residual)``, out ``[..., D]`` in ``promote(h, weight)``.

    Raises:
        ValueError: see :func:`check_norm_args` (the residual is checked like a gate: x's shape).
    """
    check_add_norm_args(x, residual, weight, eps)
    h = x + residual
    return h, _rms_norm(h, weight, eps)
