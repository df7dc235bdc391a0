"""Sigmoid Top-(k+1) routing with the Quantile-Balancing statistics in one pass: ``moe_route``.

The model's router (``KDAMoETopkRouter``) calls this kernel on CUDA through
``kdamoe.model.kernel_dispatch.moe_route_op``; ``kdamoe.model.moe_torch.moe_route_torch`` is the same function in
PyTorch (same signature, same outputs). Per token i (Kimi K3 report §2.3; DeepSeek-V3 loss-free
balancing, arXiv:2412.19437 §2.1.2, for the biased selection with unbiased gate weights):

    s_ij = σ(logit_ij)                          (float32)
    T_i ∪ {c_i} = Top-(k+1)_j (s_ij + b_j)       k dispatched experts T_i, cut-off expert c_i
    p_ij = c · s_ij / Σ_{r∈T_i} s_ir             gate weights from the UNBIASED scores (c = routed_scaling_factor)
    α_i = s_{i c_i} + b_{c_i}                    the (k+1)-th biased score
    κ_i                                          the k-th biased score
    r_ij = τ_ij − s_ij,  τ_ij = α_i if j ∈ T_i else κ_i
                                                 QB statistic: expert j is picked when b_j > r_ij

(``kdamoe.model.quantile_balancing.selection_margins`` explains why unselected experts use κ.)

Statistics, both left out for tokens whose ``token_mask`` is 0 (padding):
  * tokens per expert: how many counted tokens dispatched to each expert (one atomic per expert and program);
  * QB histogram: ``num_bins`` uniform bins per expert over ``[min(b) − 1, max(b) + 1]``; bin
    ``clamp(floor((r − lo) / width), 0, num_bins − 1)`` evaluated in float64 on the float32 ``r`` — the
    formula of ``kdamoe.model.quantile_balancing.qb_histogram``, so both count alike for the same ``r``.

Backward (``_route_bwd_kernel``, one launch): the gradient of the gate weights to the logits of the k dispatched
experts, written as whole rows with zeros elsewhere. The forward's range and the backward each once ran as about ten
small PyTorch ops per layer; at 8K tokens a training step is bound by the host's launches, so each is one kernel.
"""

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ..launch import fast_launch
from ..utils import cdiv, is_interpreter, next_power_of_2


@fast_launch
@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, mask_ptr, idx_ptr, w_ptr, count_ptr, hist_ptr,
    N, E, stride_ln, scaling,
    TOPK: tl.constexpr, KP: tl.constexpr, HAS_MASK: tl.constexpr, COUNT: tl.constexpr, HIST: tl.constexpr,
    NUM_BINS: tl.constexpr, BT: tl.constexpr, EP: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_t = pid * BT + tl.arange(0, BT)
    offs_e = tl.arange(0, EP)
    tmask = offs_t < N
    emask = offs_e < E
    m2 = tmask[:, None] & emask[None, :]
    x = tl.load(logits_ptr + offs_t.to(tl.int64)[:, None] * stride_ln + offs_e[None, :], mask=m2, other=0.0)
    s = 1.0 / (1.0 + tl.exp(-x.to(tl.float32)))
    b = tl.load(bias_ptr + offs_e, mask=emask, other=0.0)
    work = tl.where(emask[None, :], s + b[None, :], float("-inf"))
    cols = tl.arange(0, KP)
    sel_idx = tl.zeros((BT, KP), dtype=tl.int32)
    sel_s = tl.zeros((BT, KP), dtype=tl.float32)
    alpha = tl.zeros((BT,), dtype=tl.float32)
    kth = tl.zeros((BT,), dtype=tl.float32)
    picked = tl.zeros((BT, EP), dtype=tl.int32)
    # Top-(k+1) by k+1 max-reductions (k <= 64): cheaper than a sort of E columns for the k of MoE routers
    for j in tl.static_range(TOPK + 1):
        mx = tl.max(work, axis=1)
        am = tl.min(tl.where(work == mx[:, None], offs_e[None, :], EP), axis=1)  # lowest index on ties
        hit = offs_e[None, :] == am[:, None]
        if j < TOPK:
            sj = tl.sum(tl.where(hit, s, 0.0), axis=1)
            sel_idx = tl.where(cols[None, :] == j, am[:, None], sel_idx)
            sel_s = tl.where(cols[None, :] == j, sj[:, None], sel_s)
            picked = tl.where(hit, 1, picked)
            work = tl.where(hit, float("-inf"), work)
            if j == TOPK - 1:
                kth = mx
        else:
            alpha = mx
    wts = scaling * sel_s / tl.sum(sel_s, axis=1)[:, None]
    kmask = tmask[:, None] & (cols[None, :] < TOPK)
    out_off = offs_t.to(tl.int64)[:, None] * TOPK + cols[None, :]
    tl.store(idx_ptr + out_off, sel_idx.to(idx_ptr.dtype.element_ty), mask=kmask)
    tl.store(w_ptr + out_off, wts, mask=kmask)
    valid = m2
    if HAS_MASK:
        tok_ok = tl.load(mask_ptr + offs_t, mask=tmask, other=0) != 0
        valid = valid & tok_ok[:, None]
    if COUNT:
        tl.atomic_add(count_ptr + offs_e, tl.sum(tl.where(valid, picked, 0), axis=0), mask=emask)
    if HIST:
        # the range [min(b) − 1, max(b) + 1] in float64, the operations of quantile_balancing.histogram_range (each
        # program reduces the E biases itself: no separate launches for the range, no host synchronisation)
        lo = tl.min(tl.where(emask, b, float("inf")), axis=0).to(tl.float64) - 1.0
        hi = tl.max(tl.where(emask, b, float("-inf")), axis=0).to(tl.float64) + 1.0
        width = (hi - lo) / NUM_BINS
        r = (tl.where(picked != 0, alpha[:, None], kth[:, None]) - s).to(tl.float64)
        pos = (r - lo) / width
        pos = tl.minimum(tl.maximum(pos, 0.0), NUM_BINS - 1.0)  # ≥ 0, so truncation == floor
        bins = pos.to(tl.int32)
        ones = tl.full((BT, EP), 1, dtype=tl.int32)
        tl.atomic_add(hist_ptr + offs_e[None, :] * NUM_BINS + bins, ones, mask=valid)


@fast_launch
@triton.jit
def _route_bwd_kernel(
    logits_ptr, idx_ptr, dw_ptr, dlogits_ptr, N, E, stride_ln, scaling,
    TOPK: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, EP: tl.constexpr,
):
    # p_j = c·s_j/S with S = Σ_{r∈T} s_r  ⇒  ∂L/∂s_m = (c/S)(∂L/∂p_m − Σ_j ∂L/∂p_j · s_j/S), ∂s/∂logit = s(1 − s);
    # the E − k experts outside T get 0. One program writes whole rows [BT, E] (no zeros launch, no scatter).
    pid = tl.program_id(0)
    offs_t = pid * BT + tl.arange(0, BT)
    offs_e = tl.arange(0, EP)
    cols = tl.arange(0, KP)
    tmask = offs_t < N
    kmask = tmask[:, None] & (cols[None, :] < TOPK)
    rows64 = offs_t.to(tl.int64)
    idx = tl.load(idx_ptr + rows64[:, None] * TOPK + cols[None, :], mask=kmask, other=0)
    x = tl.load(logits_ptr + rows64[:, None] * stride_ln + idx, mask=kmask, other=0.0).to(tl.float32)
    s = tl.where(kmask, 1.0 / (1.0 + tl.exp(-x)), 0.0)
    ssum = tl.sum(s, axis=1)
    ssum = tl.where(tmask, ssum, 1.0)  # rows past N: no 0/0
    dw = tl.load(dw_ptr + rows64[:, None] * TOPK + cols[None, :], mask=kmask, other=0.0).to(tl.float32)
    ds = scaling / ssum[:, None] * (dw - (tl.sum(dw * s, axis=1) / ssum)[:, None])
    val = ds * s * (1.0 - s)
    out = tl.zeros((BT, EP), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        pick = cols[None, :] == j
        e_j = tl.sum(tl.where(pick, idx, 0), axis=1)
        v_j = tl.sum(tl.where(pick, val, 0.0), axis=1)
        out = tl.where(offs_e[None, :] == e_j[:, None], v_j[:, None], out)
    tl.store(dlogits_ptr + rows64[:, None] * E + offs_e[None, :], out.to(dlogits_ptr.dtype.element_ty),
             mask=tmask[:, None] & (offs_e < E)[None, :])


class MoERouting(NamedTuple):
    """Output of :func:`moe_route` (N tokens, E experts, k = top_k); unpacks like a 4-tuple."""

    top_k_index: torch.Tensor  # [N, k] int64, dispatched experts by descending biased score
    top_k_weights: torch.Tensor  # [N, k] float32, normalised unbiased scores (differentiable)
    tokens_per_expert: Optional[torch.Tensor]  # [E] float64 counted tokens per expert (None unless count_tokens)
    histogram: Optional[torch.Tensor]  # [E, num_bins] float64 QB counts of r = τ − s (None unless num_bins)


def _route_block_tokens(num_experts_pow2: int) -> int:
    """Tokens per program: a [BT, EP] tile of about 4096 scores (at most 16 tokens) on the GPU.

    The CPU interpreter runs the GPU's choice too (it pays per program, not per element, so the large tile
    is the cheaper one there as well); the tests therefore cover the tile the GPU runs.
    """
    return max(1, min(16, 4096 // num_experts_pow2))


class _RouteFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, bias, top_k, scaling, token_mask, counts, histogram, num_bins):
        n, e = logits.shape
        x = logits.contiguous()
        idx = torch.empty(n, top_k, device=x.device, dtype=torch.int64)
        w = torch.empty(n, top_k, device=x.device, dtype=torch.float32)
        hist_on, count_on = histogram is not None, counts is not None
        mask = token_mask if token_mask is not None else w
        ep = next_power_of_2(e)
        bt = _route_block_tokens(ep)
        _route_kernel[(cdiv(n, bt),)](
            x, bias, mask, idx, w, counts if count_on else w, histogram if hist_on else w,
            n, e, x.stride(0), float(scaling),
            TOPK=top_k, KP=next_power_of_2(top_k), HAS_MASK=token_mask is not None, COUNT=count_on,
            HIST=hist_on, NUM_BINS=num_bins if hist_on else 1, BT=bt, EP=ep, num_warps=4 if ep <= 256 else 8,
        )
        ctx.save_for_backward(x, idx)
        ctx.scaling = scaling
        ctx.mark_non_differentiable(idx)
        return idx, w

    @staticmethod
    def backward(ctx, _didx, dw):
        x, idx = ctx.saved_tensors
        n, e = x.shape
        top_k = idx.shape[1]
        dlogits = torch.empty(n, e, device=x.device, dtype=x.dtype)  # every entry is written
        ep = next_power_of_2(e)
        bt = _route_block_tokens(ep)
        _route_bwd_kernel[(cdiv(n, bt),)](
            x, idx, dw.contiguous(), dlogits, n, e, x.stride(0), ctx.scaling,
            TOPK=top_k, KP=next_power_of_2(top_k), BT=bt, EP=ep, num_warps=4 if ep <= 256 else 8,
        )
        return dlogits, None, None, None, None, None, None, None


def moe_route(router_logits, e_score_correction_bias, top_k, routed_scaling_factor=1.0, token_mask=None,
              count_tokens=False, num_bins=None):
    """Sigmoid router with balancing bias, Top-(k+1) selection, gate weights and the balancing statistics.

    Signature and outputs of ``kdamoe.model.moe_torch.moe_route_torch`` (the PyTorch path of the model).

    Args:
        router_logits: [N, E] raw router logits, any float dtype (CUDA, or CPU under ``TRITON_INTERPRET=1``).
        e_score_correction_bias: [E] float32 balancing bias ``b`` (selection only; no gradient).
        top_k: k dispatched experts per token, ``1 <= k < E`` (QB needs the (k+1)-th score), at most 64.
        routed_scaling_factor: c in ``p_j = c · s_j / Σ_T s``.
        token_mask: optional [N] bool or int; tokens with 0 are routed but left out of both statistics
            (padding).
        count_tokens: also return the number of counted tokens dispatched to each expert.
        num_bins: also return the QB histogram of ``r_ij = τ_ij − s_ij`` with this many bins per expert over
            ``[min(b) − 1, max(b) + 1]`` (module docstring); None: no histogram.

    Returns:
        :class:`MoERouting` ``(top_k_index [N, k] int64, top_k_weights [N, k] float32,
        tokens_per_expert [E] float64 or None, histogram [E, num_bins] float64 or None)``; counts are exact
        integers (int32 in the kernel, one call holds fewer than 2³¹ per bin). ``top_k_weights`` carries the
        gradient to ``router_logits`` (the selection itself is not differentiable).

    Raises:
        ValueError: bad shapes, dtypes, devices, ``top_k`` outside ``[1, E − 1]`` or ``num_bins < 1``.
    """
    if not isinstance(router_logits, torch.Tensor) or router_logits.dim() != 2:
        raise ValueError(f"moe_route: router_logits must be a 2-D tensor [N, E], got "
                         f"{getattr(router_logits, 'shape', type(router_logits).__name__)}")
    if not router_logits.dtype.is_floating_point:
        raise ValueError(f"moe_route: router_logits must be a float tensor, got {router_logits.dtype}")
    n, e = router_logits.shape
    if not isinstance(e_score_correction_bias, torch.Tensor) or tuple(e_score_correction_bias.shape) != (e,):
        raise ValueError(f"moe_route: e_score_correction_bias must be [E={e}], got "
                         f"{getattr(e_score_correction_bias, 'shape', None)}")
    if e_score_correction_bias.dtype != torch.float32:
        raise ValueError(f"moe_route: e_score_correction_bias must be float32, got {e_score_correction_bias.dtype}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k < e or top_k > 64:
        raise ValueError(f"moe_route: top_k must be an int with 1 <= top_k < num_experts={e} (and <= 64), "
                         f"got {top_k!r}")
    if e > 4096:
        raise ValueError(f"moe_route: at most 4096 experts supported, got {e}")
    if num_bins is not None and (isinstance(num_bins, bool) or not isinstance(num_bins, int) or num_bins < 1):
        raise ValueError(f"moe_route: num_bins must be a positive int or None, got {num_bins!r}")
    tensors = [router_logits, e_score_correction_bias]
    if token_mask is not None:
        if not isinstance(token_mask, torch.Tensor) or tuple(token_mask.shape) != (n,):
            raise ValueError(f"moe_route: token_mask must be [N={n}], got {getattr(token_mask, 'shape', None)}")
        tensors.append(token_mask)
    dev = router_logits.device
    for t in tensors:
        if t.device != dev:
            raise ValueError(f"moe_route: all tensors must be on one device, got {t.device} and {dev}")
    if dev.type != "cuda" and not (dev.type == "cpu" and is_interpreter()):
        raise ValueError(f"moe_route: Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got device {dev}")
    counts = torch.zeros(e, device=dev, dtype=torch.int32) if count_tokens else None
    histogram = torch.zeros(e, num_bins, device=dev, dtype=torch.int32) if num_bins is not None else None
    if token_mask is not None:
        token_mask = (token_mask.to(torch.int32) if token_mask.dtype == torch.bool else token_mask).contiguous()
    idx, w = _RouteFunction.apply(router_logits, e_score_correction_bias.detach().contiguous(), top_k,
                                  float(routed_scaling_factor), token_mask, counts, histogram, num_bins)
    return MoERouting(idx, w, counts.double() if counts is not None else None,
                      histogram.double() if histogram is not None else None)
