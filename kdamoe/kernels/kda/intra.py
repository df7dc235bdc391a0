"""Stage 1 of chunked KDA: intra-chunk scores, WY solve, and the chunk's w, u, kg, qg.

Per 64-token chunk and head, with ``G`` the in-chunk cumulative gate (float32) and ``Γ = exp(G)``
(WY / UT representation of the gated delta rule, Yang et al. "Gated Delta Networks";
Kimi Linear report §3):

    A_kk[i,j] = β_i Σ_d k_id k_jd exp(G_id − G_jd)      (j < i)
    A_qk[i,j] = scale Σ_d q_id k_jd exp(G_id − G_jd)    (j ≤ i)
    M = (I + A_kk)⁻¹,  w = M (β⊙k⊙Γ),  u = M (β⊙v),  kg = k ⊙ exp(G_last − G),  qg = scale·q⊙Γ

One program per chunk and head, four phases (one function each):

0. ``prepare.prepare_chunk``: the gate, its in-chunk cumsum G and the L2 norm of q and k, written to their
   outputs (the backward reads them) and read back by the phases below.
1. ``_row_block_scores``: for each 16-row block I, the rows of A_kk and A_qk against every column up to
   the block's end, as ``tl.dot`` products (the diagonal 16×16 blocks included). The anchor ``c`` is the
   *first* row of I and ``exp(G_i − G_j) = exp(G_i − G_c) · exp(G_c − G_j)``: for rows i of I,
   ``G_i − G_c ∈ [−75, 0]``; for a column j in an earlier block, ``G_c − G_j ≤ 0``; for j in I,
   ``G_c − G_j ∈ [0, 75]`` because |g| ≤ 5 over at most 15 steps — inside float32's range (exp overflows at
   88.7). A_qk goes to its output, A_kk to the M buffer (scratch).
2. ``_solve``: M = (I + A_kk)⁻¹ in place; diagonal 16×16 inverses by repeated squaring (float32 FMA
   products), the rest by block forward substitution.
3. ``_wu_kg_qg``: w and u as [64, 64] × [64, 32] products with M; kg and qg element-wise.

Phases hand data over through global memory (q, k, G and the A_kk / M buffer) behind a CTA barrier, which
keeps few tiles live (sm_90 registers and spills below, from ptxas for an sm_90 target).

Causality: the anchor is never *after* a row it serves, so a past entry (j ≤ i) is computed only from
gates at positions ≤ i and later gates cannot change its rounding; future entries (j > i) are finite and
replaced by exact zeros (a select, not a multiplication), and every later product with a triangular
matrix adds those exact zeros only.
"""

import torch
import triton
import triton.language as tl

from ..launch import autotune
from .prepare import BS, BT, chunk_bounds, prepare_buffers, prepare_chunk

# Registers / stack bytes per thread on sm_90 (triton 3.7.1, K = V = 128, ptxas resource usage):
# 4 warps 255 / 360 (2 CTAs per SM), 8 warps 254 / 0 (1 CTA), 8 warps capped at 128 registers 128 / 264
# (2 CTAs, 16 warps per SM). The autotuner picks by time; the CPU interpreter runs the first config
# (kdamoe.kernels.utils.autotune).
_INTRA_CONFIGS = [triton.Config({}, num_warps=4), triton.Config({}, num_warps=8),
                  triton.Config({}, num_warps=8, maxnreg=128), triton.Config({}, num_warps=4, maxnreg=128)]


@triton.jit
def _tile(ptr, rows, mrow, i_h, H: tl.constexpr, D: tl.constexpr):
    """Load a [len(rows), D] tile of a [T, H, D] tensor as float32 (masked rows → 0)."""
    cols = tl.arange(0, D)
    off = (rows[:, None] * H + i_h).to(tl.int64) * D + cols[None, :]
    return tl.load(ptr + off, mask=mrow[:, None], other=0.).to(tl.float32)


@triton.jit
def _row(ptr, t, i_h, H: tl.constexpr, D: tl.constexpr):
    """Load row ``t`` ([D]) of a [T, H, D] tensor as float32."""
    cols = tl.arange(0, D)
    return tl.load(ptr + (t * H + i_h).to(tl.int64) * D + cols).to(tl.float32)


@triton.jit
def _exp_where(m, x):
    """exp(x) where m, exactly 0 elsewhere; masked lanes never evaluate exp of their (arbitrary) x."""
    return tl.where(m, tl.exp(tl.where(m, x, 0.)), 0.)


@triton.jit
def _store_tile(ptr, x, rows, mrow, i_h, H: tl.constexpr, D: tl.constexpr):
    cols = tl.arange(0, D)
    off = (rows[:, None] * H + i_h).to(tl.int64) * D + cols[None, :]
    tl.store(ptr + off, x.to(ptr.dtype.element_ty), mask=mrow[:, None])


@triton.jit
def _row_block_scores(q, k, G, beta, Aqk, Ab, t0, eos, i_h, scale, I: tl.constexpr, H: tl.constexpr,
                      K: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr):
    """Rows of sub-chunk I of A_kk (with β, strictly lower) and A_qk (with scale, lower), columns [0, NJ).

    NJ (16, 32, 64, 64 for I = 0..3) covers every column j ≤ the block's last row. One [16, BK] × [BK, NJ]
    product per key slice: left rows scaled by exp(G_i − G_c), right columns by exp(G_c − G_j), c the block's
    first row; columns after the block get exactly 0 before the product. Columns ≥ NJ are never read."""
    NJ: tl.constexpr = BS if I == 0 else (2 * BS if I == 1 else BT)
    rI = t0 + I * BS + tl.arange(0, BS)
    mI = rI < eos
    ct = tl.arange(0, NJ)
    rows = t0 + ct
    mJ = (rows < eos) & (ct < (I + 1) * BS)
    offI = (rI[:, None] * H + i_h).to(tl.int64) * K
    offJ = (rows[:, None] * H + i_h).to(tl.int64) * K
    offc = (tl.minimum(t0 + I * BS, eos - 1) * H + i_h).to(tl.int64) * K  # anchor: first row of block I
    akk = tl.zeros([BS, NJ], dtype=tl.float32)
    aqk = tl.zeros([BS, NJ], dtype=tl.float32)
    for kk in range(0, K, BK):
        cols = kk + tl.arange(0, BK)
        gc = tl.load(G + offc + cols)
        gI = tl.load(G + offI + cols[None, :], mask=mI[:, None], other=0.)
        gJ = tl.load(G + offJ + cols[None, :], mask=mJ[:, None], other=0.)
        eI = _exp_where(mI[:, None], gI - gc[None, :])
        eJ = _exp_where(mJ[:, None], gc[None, :] - gJ)
        kcol = tl.trans(tl.load(k + offJ + cols[None, :], mask=mJ[:, None], other=0.).to(tl.float32) * eJ)
        akk += tl.dot(tl.load(k + offI + cols[None, :], mask=mI[:, None], other=0.).to(tl.float32) * eI, kcol)
        aqk += tl.dot(tl.load(q + offI + cols[None, :], mask=mI[:, None], other=0.).to(tl.float32) * eI, kcol)
    _store_scores(Aqk, Ab, akk, aqk, beta, t0, eos, i_h, scale, I, H, BT, BS)


@triton.jit
def _store_scores(Aqk, Ab, akk, aqk, beta, t0, eos, i_h, scale, I: tl.constexpr, H: tl.constexpr,
                  BT: tl.constexpr, BS: tl.constexpr):
    """Store row block I's [16, NJ] scores (columns 0..NJ−1): A_kk times β, strictly lower, into Ab; A_qk
    times scale, lower, into Aqk."""
    NJ: tl.constexpr = akk.shape[1]
    rI = t0 + I * BS + tl.arange(0, BS)
    mI = rI < eos
    ct = tl.arange(0, NJ)
    ri = I * BS + tl.arange(0, BS)
    b = tl.load(beta + rI * H + i_h, mask=mI, other=0.).to(tl.float32)
    akk = tl.where(ri[:, None] > ct[None, :], akk * b[:, None], 0.)
    aqk = tl.where(ri[:, None] >= ct[None, :], aqk * scale, 0.)
    off = (rI[:, None] * H + i_h).to(tl.int64) * BT + ct[None, :]
    tl.store(Aqk + off, aqk.to(Aqk.dtype.element_ty), mask=mI[:, None])
    tl.store(Ab + off, akk, mask=mI[:, None])


@triton.jit
def _blk(ptr, t0, eos, i_h, I: tl.constexpr, J: tl.constexpr, H: tl.constexpr, BT: tl.constexpr,
         BS: tl.constexpr):
    """Block (I, J) of a [T, H, 64] per-chunk matrix, read through L2 (written by this program)."""
    rI = t0 + I * BS + tl.arange(0, BS)
    off = (rI[:, None] * H + i_h).to(tl.int64) * BT + J * BS + tl.arange(0, BS)[None, :]
    return tl.load(ptr + off, mask=(rI < eos)[:, None], other=0., cache_modifier=".cg")


@triton.jit
def _inv_unit_lower(A, BS: tl.constexpr):
    """(I + A)⁻¹ for a strictly lower-triangular [BS, BS] block (BS = 16, so A¹⁶ = 0).

    (I + A)⁻¹ = Σ_{n<16} (−A)ⁿ = (I − A)(I + A²)(I + A⁴)(I + A⁸): six products, float32 FMA (``ieee``)
    because the terms can be far larger than the result and cancel. Entry (i, j) only ever combines
    entries between j and i, and entries above the diagonal stay exact zeros."""
    T = -A
    X = T + (tl.arange(0, BS)[:, None] == tl.arange(0, BS)[None, :]).to(tl.float32)
    P = T
    for _ in tl.static_range(3):
        P = tl.dot(P, P, input_precision="ieee")
        X += tl.dot(X, P, input_precision="ieee")
    return X


@triton.jit
def _store_blk(ptr, x, t0, eos, i_h, I: tl.constexpr, J: tl.constexpr, H: tl.constexpr, BT: tl.constexpr,
               BS: tl.constexpr):
    rI = t0 + I * BS + tl.arange(0, BS)
    cJ = J * BS + tl.arange(0, BS)
    off = (rI[:, None] * H + i_h).to(tl.int64) * BT + cJ[None, :]
    tl.store(ptr + off, x, mask=(rI < eos)[:, None])


@triton.jit
def _solve(Mb, t0, eos, i_h, H: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr):
    """Overwrite A_kk (in Mb) by M = (I + A_kk)⁻¹: diagonal blocks by :func:`_inv_unit_lower`, then block
    forward substitution M_IJ = −M_II Σ_{J≤L<I} A_IL M_LJ. Every A block is read before any M block is written."""
    a10 = _blk(Mb, t0, eos, i_h, 1, 0, H, BT, BS)
    a20 = _blk(Mb, t0, eos, i_h, 2, 0, H, BT, BS)
    a21 = _blk(Mb, t0, eos, i_h, 2, 1, H, BT, BS)
    a30 = _blk(Mb, t0, eos, i_h, 3, 0, H, BT, BS)
    a31 = _blk(Mb, t0, eos, i_h, 3, 1, H, BT, BS)
    a32 = _blk(Mb, t0, eos, i_h, 3, 2, H, BT, BS)
    m00 = _inv_unit_lower(_blk(Mb, t0, eos, i_h, 0, 0, H, BT, BS), BS)
    m11 = _inv_unit_lower(_blk(Mb, t0, eos, i_h, 1, 1, H, BT, BS), BS)
    m22 = _inv_unit_lower(_blk(Mb, t0, eos, i_h, 2, 2, H, BT, BS), BS)
    m33 = _inv_unit_lower(_blk(Mb, t0, eos, i_h, 3, 3, H, BT, BS), BS)
    tl.debug_barrier()  # all reads of A done before M overwrites it
    m10 = -tl.dot(m11, tl.dot(a10, m00))
    m21 = -tl.dot(m22, tl.dot(a21, m11))
    m20 = -tl.dot(m22, tl.dot(a20, m00) + tl.dot(a21, m10))
    m32 = -tl.dot(m33, tl.dot(a32, m22))
    m31 = -tl.dot(m33, tl.dot(a31, m11) + tl.dot(a32, m21))
    m30 = -tl.dot(m33, tl.dot(a30, m00) + tl.dot(a31, m10) + tl.dot(a32, m20))
    _store_blk(Mb, m00, t0, eos, i_h, 0, 0, H, BT, BS)
    _store_blk(Mb, m10, t0, eos, i_h, 1, 0, H, BT, BS)
    _store_blk(Mb, m11, t0, eos, i_h, 1, 1, H, BT, BS)
    _store_blk(Mb, m20, t0, eos, i_h, 2, 0, H, BT, BS)
    _store_blk(Mb, m21, t0, eos, i_h, 2, 1, H, BT, BS)
    _store_blk(Mb, m22, t0, eos, i_h, 2, 2, H, BT, BS)
    _store_blk(Mb, m30, t0, eos, i_h, 3, 0, H, BT, BS)
    _store_blk(Mb, m31, t0, eos, i_h, 3, 1, H, BT, BS)
    _store_blk(Mb, m32, t0, eos, i_h, 3, 2, H, BT, BS)
    _store_blk(Mb, m33, t0, eos, i_h, 3, 3, H, BT, BS)


@triton.jit
def _wu_kg_qg(q, k, v, G, beta, Mb, w, u, kg, qg, t0, eos, i_h, scale, H: tl.constexpr, K: tl.constexpr,
              V: tl.constexpr, BT: tl.constexpr):
    """w = M (β⊙k⊙Γ), u = M (β⊙v) as [64, 64] × [64, 32] products, and the element-wise kg, qg."""
    BK: tl.constexpr = 32 if K > 32 else K
    BV: tl.constexpr = 32 if V > 32 else V
    rows = t0 + tl.arange(0, BT)
    mrow = rows < eos
    ct = tl.arange(0, BT)
    tok = (rows * H + i_h).to(tl.int64)
    b_M = tl.load(Mb + tok[:, None] * BT + ct[None, :], mask=mrow[:, None] & (ct[None, :] <= ct[:, None]), other=0.,
                  cache_modifier=".cg")
    b_b = tl.load(beta + rows * H + i_h, mask=mrow, other=0.).to(tl.float32)
    offl = (tl.minimum(t0 + BT, eos) - 1) * H + i_h
    for kk in range(0, K, BK):
        cols = kk + tl.arange(0, BK)
        off = tok[:, None] * K + cols[None, :]
        b_G = tl.load(G + off, mask=mrow[:, None], other=0.)
        b_k = tl.load(k + off, mask=mrow[:, None], other=0.).to(tl.float32)
        gam = tl.where(mrow[:, None], tl.exp(b_G), 0.)
        tl.store(w + off, tl.dot(b_M, b_k * gam * b_b[:, None]).to(w.dtype.element_ty), mask=mrow[:, None])
        b_q = tl.load(q + off, mask=mrow[:, None], other=0.).to(tl.float32)
        tl.store(qg + off, (b_q * gam * scale).to(qg.dtype.element_ty), mask=mrow[:, None])
        glast = tl.load(G + offl.to(tl.int64) * K + cols)
        e = tl.where(mrow[:, None], tl.exp(glast[None, :] - b_G), 0.)
        tl.store(kg + off, (b_k * e).to(kg.dtype.element_ty), mask=mrow[:, None])
    for vv in range(0, V, BV):
        cols = vv + tl.arange(0, BV)
        off = tok[:, None] * V + cols[None, :]
        src = tl.load(v + off, mask=mrow[:, None], other=0.).to(tl.float32) * b_b[:, None]
        tl.store(u + off, tl.dot(b_M, src).to(u.dtype.element_ty), mask=mrow[:, None])


@autotune(configs=_INTRA_CONFIGS, key=['H', 'K', 'V', 'USE_L2', 'GATE_IN'])
@triton.jit
def _intra_fwd_kernel(q_in, k_in, g_in, A_log, dt_bias, q, k, rq, rk, G, v, beta, Aqk, Mb, w, u, kg, qg,
                      chunk_idx, cu_seqlens, scale, lower_bound,
                      H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
                      USE_L2: tl.constexpr, GATE_IN: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = chunk_bounds(chunk_idx, cu_seqlens, i_c, BT)
    BK: tl.constexpr = 32 if K > 32 else K

    # ---- 0. gate, in-chunk cumsum G, L2 norm: q, k below are the normalised ones (outputs, read back) ----
    prepare_chunk(q_in, k_in, g_in, q, k, rq, rk, G, A_log, dt_bias, t0, eos, i_h, lower_bound, H, K, BT, USE_L2,
                  GATE_IN, HAS_A, HAS_BIAS)
    tl.debug_barrier()  # the CTA's global writes are visible to all its threads after the barrier

    # ---- 1. A_qk (output) and A_kk (into Mb, scratch), one row block at a time ----
    _row_block_scores(q, k, G, beta, Aqk, Mb, t0, eos, i_h, scale, 0, H, K, BT, BS, BK)
    _row_block_scores(q, k, G, beta, Aqk, Mb, t0, eos, i_h, scale, 1, H, K, BT, BS, BK)
    _row_block_scores(q, k, G, beta, Aqk, Mb, t0, eos, i_h, scale, 2, H, K, BT, BS, BK)
    _row_block_scores(q, k, G, beta, Aqk, Mb, t0, eos, i_h, scale, 3, H, K, BT, BS, BK)
    tl.debug_barrier()

    # ---- 2. M = (I + A_kk)⁻¹ in place ----
    _solve(Mb, t0, eos, i_h, H, BT, BS)
    tl.debug_barrier()

    # ---- 3. w = M (β k Γ), u = M (β v), kg = k ⊙ exp(G_last − G), qg = scale·q ⊙ Γ ----
    _wu_kg_qg(q, k, v, G, beta, Mb, w, u, kg, qg, t0, eos, i_h, scale, H, K, V, BT)


def intra_fwd(q, k, g, v, beta, A_log, dt_bias, lower_bound, scale, use_l2, gate_in, chunk_idx, cu_seqlens, NC):
    """Stages 0 and 1 in one kernel on packed ``[1, T, H, ·]`` inputs (g is the raw gate input when ``gate_in``).

    Returns ``(qn, kn, rq, rk, G, Aqk, M, w, u, kg, qg)``: the :func:`prepare_buffers` tuple, then Aqk
    ``[T, H, 64]`` in the input dtype and M ``[T, H, 64]`` float32 (row-major chunk blocks; entries above the
    diagonal are never read), w, kg, qg ``[1, T, H, K]`` and u ``[1, T, H, V]`` in the input dtype."""
    _, T, H, K = k.shape
    V = v.shape[-1]
    qn, kn, rq, rk, G = prepare_buffers(q, k, use_l2)
    Aqk = torch.empty(T, H, BT, dtype=k.dtype, device=k.device)
    M = torch.empty(T, H, BT, dtype=torch.float32, device=k.device)
    w = torch.empty_like(k)
    kg = torch.empty_like(k)
    qg = torch.empty_like(q)
    u = torch.empty_like(v)
    if NC > 0:
        # read-only inputs travel twice when use_l2 is False (q_in is q): the kernel writes only to qn when USE_L2
        _intra_fwd_kernel[(NC, H)](q, k, g, A_log, dt_bias, qn, kn, rq, rk, G, v, beta, Aqk, M, w, u, kg, qg,
                                   chunk_idx, cu_seqlens, float(scale), float(lower_bound), H=H, K=K, V=V, BT=BT,
                                   BS=BS, USE_L2=use_l2, GATE_IN=gate_in, HAS_A=A_log is not None,
                                   HAS_BIAS=dt_bias is not None)
    return qn, kn, rq, rk, G, Aqk, M, w, u, kg, qg
