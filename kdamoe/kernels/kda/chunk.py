"""Chunked Kimi Delta Attention (KDA) in Triton: public function and autograd wrapper.

Math (per head; Kimi Linear report §3, Eq. 1; gated delta rule of Yang et al., chunked with the
WY/UT representation):

    S_t = (I − β_t k_t k_tᵀ) Diag(exp(g_t)) S_{t−1} + β_t k_t v_tᵀ,      o_t = S_tᵀ (scale · q_t)

Stages (one file each): ``prepare`` (gate, in-chunk cumsum, L2 norm) and ``intra`` (A_kk, A_qk on
tensor cores with the lower-bounded-gate anchor trick, WY solve, w/u/kg/qg) run as one kernel;
``state`` (sequential inter-chunk pass, forward and backward), ``output`` (o, and Aqkᵀ dO),
``backward`` (chunk-parallel gradients).
"""

from itertools import pairwise

import torch

from ..utils import cached_constant, check_slot_ids, is_interpreter
from .backward import bwd_intra, bwd_wy
from .intra import intra_fwd
from .output import dv_local, output_fwd
from .prepare import chunk_table
from .state import state_bwd, state_fwd

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


class ChunkKDAFunction(torch.autograd.Function):
    """Autograd over packed inputs ``[1, T, H, ·]``; see :func:`chunk_kda` for the meaning of each argument."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, scale, output_final_state, use_l2,
                gate_in, lower_bound, cu_seqlens, uniform_len):
        T = q.shape[1]
        N = cu_seqlens.numel() - 1
        chunk_idx, chunk_offsets, NC = chunk_table(cu_seqlens, T, uniform_len)
        qn, kn, rq, rk, G, Aqk, M, w, u, kg, qg = intra_fwd(q, k, g, v, beta, A_log, dt_bias, lower_bound, scale,
                                                            use_l2, gate_in, chunk_idx, cu_seqlens, NC)
        h, vnew, ht = state_fwd(w, u, kg, G, initial_state, cu_seqlens, chunk_offsets, NC, N, output_final_state)
        o = output_fwd(qg, h, vnew, Aqk, chunk_idx, cu_seqlens, NC)
        ctx.save_for_backward(qn, kn, v, g, beta, A_log, dt_bias, rq, rk, G, M, Aqk, w, kg, qg, h, vnew,
                              cu_seqlens, chunk_idx, chunk_offsets)
        ctx.meta = (scale, use_l2, gate_in, lower_bound, NC, N, initial_state is not None,
                    q.dtype, k.dtype, g.dtype)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        (qn, kn, v, g, beta, A_log, dt_bias, rq, rk, G, M, Aqk, w, kg, qg, h, vnew,
         cu_seqlens, chunk_idx, chunk_offsets) = ctx.saved_tensors
        scale, use_l2, gate_in, lower_bound, NC, N, has_h0, q_dtype, k_dtype, g_dtype = ctx.meta
        do = do.to(v.dtype).contiguous()
        if dht is not None:
            dht = dht.float().contiguous()
        dvl = dv_local(Aqk, do, chunk_idx, cu_seqlens, NC)
        dh, dvnew, dh0 = state_bwd(qg, G, w, kg, do, dvl, dht, cu_seqlens, chunk_offsets, NC, N, has_h0)
        dAqk, dAkk, dqd, dkd, dGd, dbd, dgl, dv = bwd_wy(qn, kn, v, G, beta, M, h, dh, vnew, dvnew, do, scale,
                                                         chunk_idx, cu_seqlens, NC)
        dq, dk, dg, dbeta, ddtb, dAl = bwd_intra(qn, kn, G, beta, dAqk, dAkk, dqd, dkd, dGd, dbd, dgl, rq, rk, g,
                                                 A_log, dt_bias, scale, lower_bound, chunk_idx, cu_seqlens, NC,
                                                 q_dtype, k_dtype, g_dtype, use_l2, gate_in)
        dA_log = ddt_bias = None
        if gate_in:
            if A_log is not None:
                dA_log = dAl.sum((0, 2)).to(A_log.dtype)
            if dt_bias is not None:
                ddt_bias = ddtb.sum(0).reshape(-1).to(dt_bias.dtype)
        dbeta = dbeta.view(beta.shape)
        if dh0 is not None:
            dh0 = dh0
        return (dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0, None, None, None, None, None, None, None)


def _check_device(name, t, device):
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} like q")


def validate_kda_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_gate_in_kernel, A_log, dt_bias,
                        lower_bound):
    """Shared argument checks of :func:`chunk_kda` and :func:`fused_recurrent_kda`; raises ValueError."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    V = v.shape[-1]
    if g.shape != q.shape:
        raise ValueError(f"g must be [B, T, H, K] = {tuple(q.shape)}, got {tuple(g.shape)}")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must be [B, T, H] = ({B}, {T}, {H}), got {tuple(beta.shape)}")
    if q.dtype not in _FLOATS:
        raise ValueError(f"q dtype must be float16, bfloat16 or float32, got {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} dtype {t.dtype} differs from q dtype {q.dtype}")
    for name, t in (("g", g), ("beta", beta)):
        if t.dtype not in _FLOATS:
            raise ValueError(f"{name} dtype must be a float type, got {t.dtype}")
    for name, d in (("K (key head dim)", K), ("V (value head dim)", V)):
        if d < 16 or d > 256 or (d & (d - 1)) != 0:
            raise ValueError(f"{name} must be a power of two in [16, 256], got {d}")
    device = q.device
    if device.type != "cuda" and not (device.type == "cpu" and is_interpreter()):
        raise ValueError(f"q is on {device}: the Triton kernels need a CUDA tensor (or CPU with TRITON_INTERPRET=1)")
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        _check_device(name, t, device)
    if scale is not None and not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a float or None, got {type(scale).__name__}")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens needs packed input with B == 1, got B={B}")
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
                or cu_seqlens.dtype not in (torch.int32, torch.int64):
            got = (f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}" if isinstance(cu_seqlens, torch.Tensor)
                   else type(cu_seqlens).__name__)
            raise ValueError(f"cu_seqlens must be a 1-D int32/int64 tensor [N+1] with N >= 1 sequence, got {got}")
        _check_device("cu_seqlens", cu_seqlens, device)
        cl = cu_seqlens.tolist()
        if cl[0] != 0 or cl[-1] != T or any(b < a for a, b in pairwise(cl)):
            raise ValueError(f"cu_seqlens must rise from 0 to T={T} without decreasing, got {cl}")
        N = len(cl) - 1
    else:
        N = B
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor) or initial_state.shape != (N, H, K, V):
            shape = tuple(initial_state.shape) if isinstance(initial_state, torch.Tensor) else type(initial_state)
            raise ValueError(f"initial_state must be [N, H, K, V] = ({N}, {H}, {K}, {V}), got {shape}")
        if initial_state.dtype not in _FLOATS:
            raise ValueError(f"initial_state dtype must be a float type, got {initial_state.dtype}")
        _check_device("initial_state", initial_state, device)
    if not (isinstance(lower_bound, (int, float)) and -5.0 <= lower_bound < 0):
        raise ValueError(f"lower_bound must be in [-5, 0) (16-token anchors need 15·|lb| < 88), got {lower_bound}")
    if use_gate_in_kernel:
        if A_log is not None:
            if not isinstance(A_log, torch.Tensor) or A_log.numel() != H:
                raise ValueError(f"A_log must have H={H} elements, got {getattr(A_log, 'shape', A_log)}")
            _check_device("A_log", A_log, device)
        if dt_bias is not None:
            if not isinstance(dt_bias, torch.Tensor) or dt_bias.numel() != H * K:
                raise ValueError(f"dt_bias must have H*K={H * K} elements, got {getattr(dt_bias, 'shape', dt_bias)}")
            _check_device("dt_bias", dt_bias, device)
    return N


def _uniform_cu(B, T, device):
    """``[0, T, 2T, …, BT]`` int32, cached (``utils.cached_constant``: built outside inference mode, so a table first
    built by an ``inference_mode`` forward can still be saved by a later training forward): building it costs two
    kernel launches, noticeable per decode step."""
    return cached_constant(("kda_uniform_cu", B, T, device),
                           lambda: torch.arange(B + 1, dtype=torch.int32, device=device) * T)


def pack(q, k, v, g, beta, cu_seqlens):
    """Flatten [B, T, ...] to the packed [1, B·T, ...] layout; returns the tensors and (cu_seqlens, uniform_len)."""
    B, T = q.shape[:2]
    if cu_seqlens is None:
        cu = _uniform_cu(B, T, q.device)
        uniform = T
    else:
        cu = cu_seqlens.to(torch.int32)
        uniform = None
    flat = [x.reshape(1, B * T, *x.shape[2:]).contiguous() for x in (q, k, v, g, beta)]
    return flat, cu.contiguous(), uniform


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, cu_seqlens=None, *, use_gate_in_kernel=False, A_log=None,
              dt_bias=None, lower_bound=-5.0, safe_gate=True, initial_state_indices=None,
              check_initial_state_indices_values=True):
    r"""Chunked KDA (training / prefill), differentiable, fla-compatible signature.

    Computes, per sequence and head (Kimi Linear report §3, Eq. 1), with state ``S ∈ R^{K×V}``::

        S_t = (I − β_t k_t k_tᵀ) Diag(exp(g_t)) S_{t−1} + β_t k_t v_tᵀ,    o_t = S_tᵀ (scale · q_t)

    in 64-token chunks (WY representation, Yang et al.), with every intra-chunk block on tensor cores
    (16-token sub-chunks anchored at their first row; safe because ``g ≥ lower_bound ≥ −5``).

    Args:
        q, k: ``[B, T, H, K]`` float16 / bfloat16 / float32 (same dtype as v).
        v: ``[B, T, H, V]``. K and V must be powers of two in [16, 256].
        g: ``[B, T, H, K]`` log decay (natural log, per channel), any float dtype; used in float32.
            With ``use_gate_in_kernel=True`` it is the raw gate input f and the kernel computes
            ``g = lower_bound · sigmoid(exp(A_log) · (f + dt_bias))`` in float32.
            Precomputed gates must lie in ``[lower_bound, 0]``. This is *not* checked (a check costs a
            pass over g). Gates a little below the bound are harmless while every 16-token sum stays
            above −88; beyond that an anchor factor overflows to inf and the output becomes NaN/inf.
            Positive gates make ``exp(G)`` exceed 1 and can overflow the same way.
        beta: ``[B, T, H]`` step sizes (normally in [0, 1]).
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` (N = B, or the number of sequences with cu_seqlens), any float
            dtype, used in float32. Differentiable.
        output_final_state: also return the ``[N, H, K, V]`` float32 state after the last token.
        use_qk_l2norm_in_kernel: replace q, k by ``x · rsqrt(Σx² + 1e-6)`` over K (differentiable).
        cu_seqlens: int ``[N+1]`` cumulative lengths of packed sequences (FlashAttention convention);
            requires B == 1. Each sequence starts from its own initial state.
        use_gate_in_kernel, A_log (``[H]`` or None), dt_bias (``[H·K]`` or None), lower_bound (in
            [−5, 0)): the lower-bounded gate; A_log None means a factor 1 (``lb·sigmoid(f + dt_bias)``).
        safe_gate: accepted for drop-in use with fla; this kernel always relies on the bounded gate.
        initial_state_indices: optional int32 / int64 ``[N]`` on q's device, distinct, in ``[0, P)`` (the names of
            sglang's / vLLM's chunked linear-attention ops): ``initial_state`` is then a state pool
            ``[P, H, K, V]`` (contiguous float32, e.g. the rollout engine's per-slot states) and sequence n starts
            from ``initial_state[initial_state_indices[n]]``; with ``output_final_state`` its final state is
            written back to that row in place (the other rows are not touched) and ``final_state`` is None.
            Forward only: refused while grad mode is on and an input requires grad.
        check_initial_state_indices_values: check the indices' range and distinctness (a device synchronisation,
            see ``kdamoe.kernels.utils.check_slot_ids``); False for indices valid by construction (the engine's
            slots).

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, H, V]`` in v's dtype; ``final_state`` float32 or None (always None
        with ``initial_state_indices``: the final states are in the pool).

    Raises:
        ValueError: wrong shapes, dtypes, devices, head dims, lower_bound, or cu_seqlens with B > 1; with
            ``initial_state_indices``: a pool that is not a contiguous float32 ``[P, H, K, V]`` tensor on q's
            device, indices of the wrong shape / dtype / device, out of ``[0, P)`` or repeated (when checked),
            or an input requiring grad while grad mode is on (naming the bad argument or value).
    """
    if initial_state_indices is not None:
        return _chunk_kda_pool(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                               cu_seqlens, use_gate_in_kernel, A_log, dt_bias, lower_bound, initial_state_indices,
                               check_initial_state_indices_values)
    validate_kda_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_gate_in_kernel, A_log, dt_bias,
                        lower_bound)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if scale is None:
        scale = K ** -0.5
    (qf, kf, vf, gf, bf), cu, uniform = pack(q, k, v, g, beta, cu_seqlens)
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    A, dtb = _gate_params(use_gate_in_kernel, A_log, dt_bias, H, K)
    o, ht = ChunkKDAFunction.apply(qf, kf, vf, gf, bf, A, dtb, h0, float(scale), bool(output_final_state),
                                   bool(use_qk_l2norm_in_kernel), bool(use_gate_in_kernel), float(lower_bound),
                                   cu, uniform)
    return o.view(B, T, H, V), ht


def _gate_params(use_gate_in_kernel, A_log, dt_bias, H, K):
    """``(A [H], dt_bias [H·K])`` contiguous as the kernels read them, None where absent or without the gate."""
    if not use_gate_in_kernel:
        return None, None
    A = A_log.reshape(H).contiguous() if A_log is not None else None
    dtb = dt_bias.reshape(H * K).contiguous() if dt_bias is not None else None
    return A, dtb


def _chunk_kda_pool(q, k, v, g, beta, scale, pool, output_final_state, use_l2, cu_seqlens, gate_in, A_log, dt_bias,
                    lower_bound, indices, check_values):
    """:func:`chunk_kda` with ``initial_state_indices``: the forward stages of :class:`ChunkKDAFunction` with the
    state pass reading (and writing) the pool rows ``indices`` in place; no autograd graph."""
    N = validate_kda_inputs(q, k, v, g, beta, scale, None, cu_seqlens, gate_in, A_log, dt_bias, lower_bound)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if not isinstance(pool, torch.Tensor) or pool.dim() != 4 or pool.shape[1:] != (H, K, V):
        shape = tuple(pool.shape) if isinstance(pool, torch.Tensor) else type(pool).__name__
        raise ValueError(f"chunk_kda: with initial_state_indices, initial_state must be a pool [P, H, K, V] = "
                         f"(P, {H}, {K}, {V}), got {shape}")
    # the pool is read and written in place: no float32 or contiguous copy may stand in for it
    if pool.dtype != torch.float32 or not pool.is_contiguous():
        raise ValueError(f"chunk_kda: with initial_state_indices, initial_state must be a contiguous float32 pool "
                         f"(updated in place), got {pool.dtype}{'' if pool.is_contiguous() else ', not contiguous'}")
    _check_device("initial_state", pool, q.device)
    check_slot_ids(indices, N, pool.shape[0], q.device, check_values, "chunk_kda", name="initial_state_indices")
    if torch.is_grad_enabled():
        for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("A_log", A_log),
                        ("dt_bias", dt_bias), ("initial_state", pool)):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                raise ValueError(f"chunk_kda with initial_state_indices has no backward, but {name} requires grad; "
                                 "run it under torch.no_grad() or pass per-sequence initial states")
    if scale is None:
        scale = K ** -0.5
    (qf, kf, vf, gf, bf), cu, uniform = pack(q, k, v, g, beta, cu_seqlens)
    A, dtb = _gate_params(gate_in, A_log, dt_bias, H, K)
    # ChunkKDAFunction.forward's three stages, the state pass on the pool rows
    chunk_idx, chunk_offsets, NC = chunk_table(cu, T, uniform)
    _, _, _, _, G, Aqk, _, w, u, kg, qg = intra_fwd(qf, kf, gf, vf, bf, A, dtb, float(lower_bound), float(scale),
                                                    bool(use_l2), bool(gate_in), chunk_idx, cu, NC)
    h, vnew, _ = state_fwd(w, u, kg, G, pool, cu, chunk_offsets, NC, N, bool(output_final_state), h0_indices=indices)
    o = output_fwd(qg, h, vnew, Aqk, chunk_idx, cu, NC)
    return o.view(B, T, H, V), None
