"""Pure-PyTorch Block Attention Residuals mix: the CPU path of the model's AttnRes mixes and the reference of the
Triton kernel ``kdamoe.kernels.block_attnres``.

Block AttnRes (Attention Residuals, arXiv:2603.15031, §3 "Block AttnRes") replaces the residual sum that feeds a
sublayer by a softmax over depth: with the ``S`` sources ``v_1 … v_S`` (the finished block sums, the embeddings
first, then the current block's partial sum), a learned pseudo-query ``q [d]`` and the key RMSNorm weight
``γ [d]``::

    l_i = q · RMSNorm_γ(v_i)          (float32)
    h   = Σ_i softmax_i(l) v_i        (softmax over the S sources, in float32)

This path keeps the model's original form: the sources are stacked (their dtypes promoted), the key norm is
:func:`kdamoe.model.norm_torch.rms_norm_torch` (its rounding points), the float32 softmax weights are rounded to the
sources' dtype and the weighted sum is taken in that dtype.

Remote-code rule (docs/architecture.md §7): this file is copied next to saved weights; it imports only torch and a
same-folder module.
"""

from collections.abc import Sequence

import torch

from .norm_torch import rms_norm_torch

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


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


def block_attnres_torch(sources: Sequence[torch.Tensor], query: torch.Tensor, key_weight: torch.Tensor,
                        eps: float) -> torch.Tensor:
    """``h = Σ_i softmax_i(q · RMSNorm_γ(v_i)) v_i`` over the sources (see the module docstring).

    Args:
        sources: ``S ≥ 1`` tensors ``[..., d]`` of one shape and device, float16 / bfloat16 / float32 / float64
            (dtypes may differ: they are promoted): the finished block sums and the current partial sum.
        query: the pseudo-query ``q [d]``, any float dtype.
        key_weight: the key RMSNorm weight ``γ [d]``, any float dtype.
        eps: added to the mean square of the key norm (unitless, ≥ 0).

    Returns:
        ``[..., d]`` in :func:`mix_dtype` of the sources.

    Raises:
        ValueError: see :func:`check_attnres_args`.
    """
    check_attnres_args(sources, query, key_weight, eps)
    stacked = torch.stack(tuple(sources))  # [S, ..., d] in the promoted dtype
    logits = (rms_norm_torch(stacked, key_weight, eps).float() * query.float()).sum(-1)  # [S, ...]
    weights = logits.softmax(dim=0).to(stacked.dtype)
    return (weights.unsqueeze(-1) * stacked).sum(0)
