"""Block AttnRes mix in Triton: the public function and its autograd Function.

Semantics are those of ``kdamoe.model.attnres_torch.block_attnres_torch`` (the reference) computed in float32 without
its intermediate roundings; the launches are in ``forward.py`` and ``backward.py``. The sources are passed to the
kernels as they are (a tuple of views), never stacked: the mix reads ``S`` tensors in place and, in the backward,
returns one gradient per source.
"""

from collections.abc import Sequence

import torch
from torch.autograd.function import once_differentiable

from ..utils import is_interpreter
from .backward import attnres_backward
from .forward import MAX_D, attnres_forward

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


# The op's own argument checks (the same rules as the PyTorch reference in kdamoe/model/, which keeps its own
# copy: the model folder loads without kdamoe.kernels, and the kernels import nothing but torch and triton).
def check_attnres_args(sources, query, key_weight, eps, floats=_FLOATS) -> None:
    """Shape / dtype / device checks of the AttnRes mix (no value is read: no host sync).

    Raises:
        ValueError: naming the bad argument: ``sources`` not a non-empty list / tuple of tensors, sources of
            different shapes or devices, a source without a last dim, ``query`` / ``key_weight`` not ``[d]``
            tensors with ``d`` the sources' last dim, a dtype outside ``floats``, a tensor on another device than
            the sources, or ``eps`` not a non-negative float. The sources' dtypes may differ (under autocast the
            float32 embeddings meet bfloat16 sublayer outputs).
    """
    if not isinstance(sources, (list, tuple)) or len(sources) == 0:
        got = f"an empty {type(sources).__name__}" if isinstance(sources, (list, tuple)) else type(sources).__name__
        raise ValueError(f"sources must be a non-empty list or tuple of tensors, got {got}")
    for i, v in enumerate(sources):
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"sources[{i}] must be a torch.Tensor, got {type(v).__name__}")
    first = sources[0]
    if first.dim() < 1 or first.shape[-1] < 1:
        raise ValueError(f"sources[0] must be [..., d] with d >= 1, got shape {tuple(first.shape)}")
    for i, v in enumerate(sources):
        if v.shape != first.shape or v.device != first.device:
            raise ValueError(f"sources[{i}] is {tuple(v.shape)} on {v.device}; every source must match sources[0]: "
                             f"{tuple(first.shape)} on {first.device}")
        if v.dtype not in floats:
            raise ValueError(f"sources[{i}] dtype must be one of {floats}, got {v.dtype}")
    d = first.shape[-1]
    for name, t in (("query", query), ("key_weight", key_weight)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.shape != (d,):
            raise ValueError(f"{name} must be [d] = ({d},) like the sources' last dim, got shape {tuple(t.shape)}")
        if t.dtype not in floats:
            raise ValueError(f"{name} dtype must be one of {floats}, got {t.dtype}")
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device}, expected {first.device} like the sources")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a float >= 0, got {eps!r}")


def mix_dtype(sources: Sequence[torch.Tensor]) -> torch.dtype:
    """The dtype of the mix: the sources' dtypes promoted (what stacking them gives)."""
    dtype = sources[0].dtype
    for v in sources[1:]:
        dtype = torch.promote_types(dtype, v.dtype)
    return dtype



def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous ``[rows, d]`` (a view when ``t`` is contiguous, the case of every model source)."""
    return t.reshape(-1, t.shape[-1]).contiguous()


class BlockAttnResFunction(torch.autograd.Function):
    """Autograd of :func:`block_attnres`: differentiable in the query, the key-norm weight and every source."""

    @staticmethod
    def forward(ctx, query, key_weight, eps, *sources):
        rows = tuple(_rows(v) for v in sources)
        query, key_weight = query.contiguous(), key_weight.contiguous()
        out, lse = attnres_forward(rows, query, key_weight, eps, mix_dtype(sources))
        ctx.save_for_backward(query, key_weight, lse, *rows)
        ctx.eps, ctx.shape = eps, sources[0].shape
        return out.view(ctx.shape)

    @staticmethod
    @once_differentiable  # the backward is a kernel: a double backward raises instead of treating it as constant
    def backward(ctx, dh):
        query, key_weight, lse, *rows = ctx.saved_tensors
        dv, u = attnres_backward(tuple(rows), query, key_weight, lse, _rows(dh), ctx.eps)
        dq = (key_weight.float() * u).to(query.dtype)
        dgamma = (query.float() * u).to(key_weight.dtype)
        return (dq, dgamma, None, *(g.view(ctx.shape) for g in dv))


def block_attnres(sources: Sequence[torch.Tensor], query: torch.Tensor, key_weight: torch.Tensor,
                  eps: float) -> torch.Tensor:
    r"""Block AttnRes mix ``h = Σ_i softmax_i(q · RMSNorm_γ(v_i)) v_i`` (Attention Residuals, arXiv:2603.15031),
    one kernel forward and one backward; differentiable in every source, ``query`` and ``key_weight``.

    Logits, softmax and the weighted sum in float32 (the query / weight gradients are summed over rows in float32,
    deterministically); the result of :func:`kdamoe.model.attnres_torch.block_attnres_torch` without that reference's
    roundings of the normalised keys and softmax weights to the sources' dtype.

    Args:
        sources: ``S ≥ 1`` tensors ``[..., d]`` of one shape and device, float16 / bfloat16 / float32 (dtypes may
            differ, e.g. float32 embeddings and bfloat16 sublayer outputs under autocast), 1 ≤ d ≤ 8192; read in
            place when contiguous (else copied). The kernel is compiled once per ``S`` and dtype combination.
        query: the pseudo-query ``q [d]``, float16 / bfloat16 / float32.
        key_weight: the key RMSNorm weight ``γ [d]``, float16 / bfloat16 / float32.
        eps: added to the key norm's mean square (≥ 0).

    Returns:
        ``[..., d]`` in the sources' promoted dtype (:func:`mix_dtype`); each source's
        gradient in its own dtype.

    Raises:
        ValueError: bad sources, shapes, dtypes, devices or eps (see
            :func:`check_attnres_args`), ``d > 8192``, or a device the kernels cannot run on.
    """
    check_attnres_args(sources, query, key_weight, eps, floats=_FLOATS)
    d, device = sources[0].shape[-1], sources[0].device
    if d > MAX_D:
        raise ValueError(f"the sources' last dim d = {d} exceeds the kernels' maximum {MAX_D}")
    if device.type != "cuda" and not (device.type == "cpu" and is_interpreter()):
        raise ValueError(f"sources are on {device}: the Triton kernels need CUDA tensors "
                         "(or CPU with TRITON_INTERPRET=1)")
    return BlockAttnResFunction.apply(query, key_weight, float(eps), *sources)
