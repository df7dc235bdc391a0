"""One KDA decode step for N sequences whose recurrent states live in a slot pool, read and written in place.

The batched rollout engine keeps one float32 state ``[H, K, V]`` per cache slot in a pool ``[num_slots, H, K, V]``
per KDA layer. :func:`fused_recurrent_kda` takes an ``initial_state [N, H, K, V]`` and returns a new
``final_state``, so the engine gathered ``pool[slot_ids]`` and scattered the result back: two copies of every
active state per layer and step (at K = V = 128, H = 16 that is 1 MiB per sequence each way). Here the program of
sequence ``n`` reads its state at ``pool[slot_ids[n]]`` and writes it back to the same place, so a step moves each
active state once in and once out and nothing else.

Math per head (Kimi Linear report §3, Eq. 1), the same as :mod:`.fused_recurrent`::

    g = lb · σ(exp(A_log) · (f + dt_bias))           (the lower-bounded gate, with ``use_gate_in_kernel``)
    S' = Diag(exp(g)) S;   S = S' + β k (v − S'ᵀ k)ᵀ;   o = Sᵀ (scale · q)

Reference: ``naive.naive_recurrent_kda_slots`` (float64 gather → recurrence → scatter).
"""

import torch
import triton
import triton.language as tl

from ..launch import fast_launch
from ..utils import check_slot_ids
from .chunk import validate_kda_inputs


@fast_launch
@triton.jit
def _recurrent_slots_kernel(q, k, v, g, beta, A_log, dt_bias, o, pool, slot_ids, scale, lower_bound,
                            sq, sk, sv, sg, sb, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                            BV: tl.constexpr, USE_L2: tl.constexpr, GATE_IN: tl.constexpr, HAS_A: tl.constexpr,
                            HAS_BIAS: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    slot = tl.load(slot_ids + i_n).to(tl.int64)
    ck = tl.arange(0, K)
    cv = i_v * BV + tl.arange(0, BV)
    # this program owns columns cv of one slot's state: no other program reads or writes them, so the in-place
    # update needs no synchronisation (slot ids are distinct)
    soff = (slot * H + i_h) * K * V + ck[:, None] * V + cv[None, :]
    S = tl.load(pool + soff)
    row = i_n.to(tl.int64)
    b_q = tl.load(q + row * sq + i_h * K + ck).to(tl.float32)
    b_k = tl.load(k + row * sk + i_h * K + ck).to(tl.float32)
    b_v = tl.load(v + row * sv + i_h * V + cv).to(tl.float32)
    b_g = tl.load(g + row * sg + i_h * K + ck).to(tl.float32)
    b_b = tl.load(beta + row * sb + i_h).to(tl.float32)
    if USE_L2:
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6)
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
    if GATE_IN:
        if HAS_BIAS:
            b_g += tl.load(dt_bias + i_h * K + ck).to(tl.float32)
        if HAS_A:
            b_g *= tl.exp(tl.load(A_log + i_h).to(tl.float32))
        b_g = lower_bound * tl.sigmoid(b_g)
    S = S * tl.exp(b_g)[:, None]
    pred = tl.sum(S * b_k[:, None], 0)
    S += (b_b * b_k)[:, None] * (b_v - pred)[None, :]
    b_o = tl.sum(S * (b_q * scale)[:, None], 0)
    tl.store(o + (row * H + i_h) * V + cv, b_o.to(o.dtype.element_ty))
    tl.store(pool + soff, S)


def _rows(x, tail):
    """``x`` as the kernel reads it: the trailing dims ``tail`` contiguous, rows any stride (e.g. column views of a
    fused projection's output); else a contiguous copy. Returns ``(tensor, row stride)``."""
    expect, stride = [], 1
    for d in reversed(tail):
        expect.insert(0, stride)
        stride *= d
    if list(x.stride()[1:]) != expect:
        x = x.contiguous()
    return x, x.stride(0)


def fused_recurrent_kda_slots(q, k, v, g, beta, state_pool, slot_ids, *, scale=None, use_qk_l2norm_in_kernel=False,
                              use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=-5.0,
                              check_slot_ids_values=True):
    r"""One decode token for each of N sequences, each continuing the state ``state_pool[slot_ids[n]]``, which is
    updated in place (no gather, no scatter, no new state tensor). Forward only.

    Per sequence and head (Kimi Linear report §3, Eq. 1)::

        S ← (I − β k kᵀ) Diag(exp(g)) S + β k vᵀ,    o = Sᵀ (scale · q)

    with S in float32 throughout: equal to ``fused_recurrent_kda`` on ``pool[slot_ids]`` followed by
    ``pool[slot_ids] = final_state``.

    Args:
        q, k: ``[N, H, K]`` float16 / bfloat16 / float32 (heads and channels contiguous; the row stride is free, so
            column views of one ``[N, 3·H·K]`` tensor are read in place).
        v: ``[N, H, V]`` q's dtype. K and V powers of two in [16, 256].
        g: ``[N, H, K]`` log decay, or the raw gate input f with ``use_gate_in_kernel``; any float dtype.
        beta: ``[N, H]`` step sizes, any float dtype.
        state_pool: ``[num_slots, H, K, V]`` float32, contiguous; rows ``slot_ids`` are read and overwritten, the
            others are not touched.
        slot_ids: ``[N]`` int32 / int64, distinct, in ``[0, num_slots)``, on q's device.
        scale: query scale, default ``K ** -0.5``.
        use_qk_l2norm_in_kernel: replace q, k by ``x · rsqrt(Σx² + 1e-6)`` over K.
        use_gate_in_kernel, A_log (``[H]`` or None: factor 1), dt_bias (``[H·K]`` or None), lower_bound (in
            [−5, 0)): the lower-bounded gate ``g = lower_bound · σ(exp(A_log) · (f + dt_bias))`` in float32.
        check_slot_ids_values: check the ids' range and distinctness (a device synchronisation; see
            ``kdamoe.kernels.utils.check_slot_ids``); False for ids valid by construction.

    Returns:
        ``o [N, H, V]`` in v's dtype.

    Raises:
        ValueError: ``lower_bound=None`` with ``use_gate_in_kernel`` (Kimi Linear's unbounded gate: kdamoe's KDA
            kernels are written for the bounded one; run fla's or PyTorch's op); the errors of ``chunk_kda`` for
            q, k, v, g, beta, the gate and the device; a state pool that is not a contiguous float32
            ``[num_slots, H, K, V]`` tensor on q's device; bad ``slot_ids``; any input requiring grad while grad
            mode is on (there is no backward).
    """
    if use_gate_in_kernel and lower_bound is None:
        raise ValueError("fused_recurrent_kda_slots cannot run the unbounded KDA gate (lower_bound=None): kdamoe's "
                         "KDA kernels are written for the bounded gate; run fla's or PyTorch's op instead")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor [N, H, ·], got {getattr(t, 'shape', type(t).__name__)}")
    if not isinstance(beta, torch.Tensor) or beta.dim() != 2:
        raise ValueError(f"beta must be [N, H], got {getattr(beta, 'shape', type(beta).__name__)}")
    # the shared checks of chunk_kda / fused_recurrent_kda, on [N, 1, ·] views (N sequences of one token)
    validate_kda_inputs(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], scale, None, None,
                        use_gate_in_kernel, A_log, dt_bias, lower_bound)
    N, H, K = q.shape
    V = v.shape[-1]
    if not isinstance(state_pool, torch.Tensor) or state_pool.dim() != 4 or state_pool.shape[1:] != (H, K, V):
        shape = tuple(state_pool.shape) if isinstance(state_pool, torch.Tensor) else type(state_pool).__name__
        raise ValueError(f"state_pool must be [num_slots, H, K, V] = (num_slots, {H}, {K}, {V}), got {shape}")
    if state_pool.dtype != torch.float32 or not state_pool.is_contiguous():
        raise ValueError(f"state_pool must be a contiguous float32 tensor (updated in place), got {state_pool.dtype}"
                         f"{'' if state_pool.is_contiguous() else ', not contiguous'}")
    if state_pool.device != q.device:
        raise ValueError(f"state_pool is on {state_pool.device}, expected {q.device} like q")
    check_slot_ids(slot_ids, N, state_pool.shape[0], q.device, check_slot_ids_values, "fused_recurrent_kda_slots")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta)):
        raise ValueError("fused_recurrent_kda_slots has no backward: an input requires grad; run it under "
                         "torch.no_grad() or use chunk_kda")
    if scale is None:
        scale = K ** -0.5
    o = torch.empty(N, H, V, dtype=v.dtype, device=v.device)
    if N == 0:
        return o
    (qf, sq), (kf, sk), (gf, sg) = (_rows(x, (H, K)) for x in (q, k, g))
    vf, sv = _rows(v, (H, V))
    bf, sb = _rows(beta, (H,))
    A = dtb = None
    if use_gate_in_kernel:
        A = A_log.reshape(H).contiguous() if A_log is not None else None
        dtb = dt_bias.reshape(H * K).contiguous() if dt_bias is not None else None
    # the fused_recurrent_kda choice: narrower value blocks when few (sequence, head) pairs would fill the GPU
    BV = min(32, V) if N * H < 256 else min(64, V)
    _recurrent_slots_kernel[(V // BV, N * H)](
        qf, kf, vf, gf, bf, A, dtb, o, state_pool, slot_ids, float(scale), float(lower_bound),
        sq, sk, sv, sg, sb, H=H, K=K, V=V, BV=BV, USE_L2=bool(use_qk_l2norm_in_kernel),
        GATE_IN=bool(use_gate_in_kernel), HAS_A=A is not None, HAS_BIAS=dtb is not None, num_warps=4)
    return o
