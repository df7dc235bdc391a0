"""Fused recurrent KDA: token-by-token kernel for decoding (forward only).

Per sequence, head and value block, the float32 state ``S ∈ R^{K×BV}`` stays in registers while the
kernel walks the tokens (Kimi Linear report §3, Eq. 1):

    S' = Diag(exp(g_t)) S;   S = S' + β_t k_t (v_t − S'ᵀ k_t)ᵀ;   o_t = Sᵀ (scale · q_t)

which equals ``(I − β k kᵀ) Diag(exp g) S + β k vᵀ``.
"""

import torch
import triton
import triton.language as tl

from ..launch import fast_launch
from .chunk import _uniform_cu, validate_kda_inputs


@fast_launch
@triton.jit
def _fused_recurrent_kernel(q, k, v, g, beta, A_log, dt_bias, o, h0, ht, cu_seqlens, scale, lower_bound,
                            H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                            USE_L2: tl.constexpr, GATE_IN: tl.constexpr, HAS_A: tl.constexpr,
                            HAS_BIAS: tl.constexpr, HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens + i_n)
    eos = tl.load(cu_seqlens + i_n + 1)
    ck = tl.arange(0, K)
    cv = i_v * BV + tl.arange(0, BV)
    soff = ck[:, None] * V + cv[None, :]
    sbase = (i_n * H + i_h).to(tl.int64) * K * V
    if HAS_H0:
        S = tl.load(h0 + sbase + soff).to(tl.float32)
    else:
        S = tl.zeros([K, BV], dtype=tl.float32)
    if GATE_IN:
        if HAS_A:
            ea = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        else:
            ea = 1.0
        if HAS_BIAS:
            bias = tl.load(dt_bias + i_h * K + ck).to(tl.float32)
        else:
            bias = tl.zeros([K], dtype=tl.float32)
    for t in range(bos, eos):
        tok = (t * H + i_h).to(tl.int64)
        b_q = tl.load(q + tok * K + ck).to(tl.float32)
        b_k = tl.load(k + tok * K + ck).to(tl.float32)
        b_v = tl.load(v + tok * V + cv).to(tl.float32)
        b_g = tl.load(g + tok * K + ck).to(tl.float32)
        b_b = tl.load(beta + tok).to(tl.float32)
        if USE_L2:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
        if GATE_IN:
            b_g = lower_bound * tl.sigmoid((b_g + bias) * ea)
        S = S * tl.exp(b_g)[:, None]
        pred = tl.sum(S * b_k[:, None], 0)
        S += (b_b * b_k)[:, None] * (b_v - pred)[None, :]
        b_o = tl.sum(S * (b_q * scale)[:, None], 0)
        tl.store(o + tok * V + cv, b_o.to(o.dtype.element_ty))
    if STORE_FINAL:
        tl.store(ht + sbase + soff, S)


def fused_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=False, cu_seqlens=None, *, use_gate_in_kernel=False, A_log=None,
                        dt_bias=None, lower_bound=-5.0, safe_gate=True):
    r"""Token-by-token KDA for decoding; same arguments and results as :func:`chunk_kda`, no gradient.

    Computes ``S_t = (I − β_t k_t k_tᵀ) Diag(exp(g_t)) S_{t−1} + β_t k_t v_tᵀ``, ``o_t = S_tᵀ (scale·q_t)``
    (Kimi Linear report §3, Eq. 1) with the state in float32 registers. Any gate values are fine here
    (no anchor trick), but ``lower_bound`` must still be in [−5, 0) as for ``chunk_kda``.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H, K]`` log decay (or raw f with
            ``use_gate_in_kernel``); beta: ``[B, T, H]``; initial_state: ``[N, H, K, V]``;
            cu_seqlens: int ``[N+1]`` with B == 1. Typical decode: T = 1, N = B.

    Returns:
        ``(o [B, T, H, V] in v's dtype, final_state [N, H, K, V] float32 or None)``.

    Raises:
        ValueError: as :func:`chunk_kda`.
    """
    validate_kda_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_gate_in_kernel, A_log, dt_bias,
                        lower_bound)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if scale is None:
        scale = K ** -0.5
    # The kernel reads raw pointers: a contiguous [B, T, H, ·] tensor already has the packed [1, B·T, H, ·]
    # layout, so no reshape (each costs host time, and a decode step is host-bound at small B).
    qf, kf, vf, gf, bf = (x if x.is_contiguous() else x.contiguous() for x in (q, k, v, g, beta))
    cu = _uniform_cu(B, T, q.device) if cu_seqlens is None else cu_seqlens.to(torch.int32).contiguous()
    N = cu.numel() - 1
    o = torch.empty(B, T, H, V, dtype=v.dtype, device=v.device)
    h0 = initial_state if initial_state is None or initial_state.is_contiguous() else initial_state.contiguous()
    ht = torch.empty(N, H, K, V, dtype=torch.float32, device=q.device) if output_final_state else None
    A = dtb = None
    if use_gate_in_kernel:
        A = A_log.reshape(H).contiguous() if A_log is not None else None
        dtb = dt_bias.reshape(H * K).contiguous() if dt_bias is not None else None
    BV = min(32, V) if N * H < 256 else min(64, V)
    _fused_recurrent_kernel[(V // BV, N * H)](
        qf, kf, vf, gf, bf, A, dtb, o, h0, ht, cu, float(scale), float(lower_bound), H=H, K=K, V=V, BV=BV,
        USE_L2=bool(use_qk_l2norm_in_kernel), GATE_IN=bool(use_gate_in_kernel), HAS_A=A is not None,
        HAS_BIAS=dtb is not None, HAS_H0=h0 is not None, STORE_FINAL=bool(output_final_state), num_warps=4)
    return o, ht
