"""Stage 1 of chunked KDA: intra-chunk scores, WY solve, and the chunk's w, u, kg.

Per 64-token chunk and head, with ``G`` the in-chunk cumulative gate (float32) and ``Γ = exp(G)``
(WY / UT representation of the gated delta rule, Yang et al. "Gated Delta Networks";
Kimi Linear report §3):

    A_kk[i,j] = β_i Σ_d k_id k_jd exp(G_id − G_jd)      (j < i)
    A_qk[i,j] = scale Σ_d q_id k_jd exp(G_id − G_jd)    (j ≤ i)
    M = (I + A_kk)⁻¹,  w = M (β⊙k⊙Γ),  u = M (β⊙v),  kg = k ⊙ exp(G_last − G)

Every 16×16 block of A (the diagonal ones included) is one ``tl.dot``: for a row block I the anchor
``c`` is the *first* row of I, and ``exp(G_i − G_j) = exp(G_i − G_c) · exp(G_c − G_j)``.
For rows i of block I, ``G_i − G_c ∈ [−75, 0]``; for a column j in an earlier block,
``G_c − G_j ≤ 0``; for j in block I, ``G_c − G_j ∈ [0, 75]`` because |g| ≤ 5 over at most 15 steps —
inside float32's range (exp overflows at 88.7). The anchor is never *after* a row it serves, so a
past entry (j ≤ i) is computed only from gates at positions ≤ i: later gates cannot change its
rounding. Future entries (j > i) are finite and then replaced by exact zeros (a select, not a
multiplication), so no inf·0 can appear.
"""

import torch
import triton
import triton.language as tl

from ..utils import autotune
from .prepare import BT, BS, chunk_bounds

# Stack (spill) bytes per thread on sm_90, triton 3.7.1 (cuobjdump): 3216 at 4 warps and 920 at 8 before the
# key dimension of _pair was sliced, 1520 and 368 after. The autotuner picks the faster of the two.
_INTRA_CONFIGS = [triton.Config({}, num_warps=4), triton.Config({}, num_warps=8)]


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
def _store_tile(ptr, x, rows, mrow, i_h, H: tl.constexpr, D: tl.constexpr):
    cols = tl.arange(0, D)
    off = (rows[:, None] * H + i_h).to(tl.int64) * D + cols[None, :]
    tl.store(ptr + off, x.to(ptr.dtype.element_ty), mask=mrow[:, None])


@triton.jit
def _pair(q, k, G, t0, eos, i_h, I: tl.constexpr, J: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
          BS: tl.constexpr):
    """Blocks (I, J) of Σ_d k_i k_j exp(G_i−G_j) and Σ_d q_i k_j exp(G_i−G_j) (no β, no scale, no mask).

    The key dimension is taken in slices of at most 32 channels so that few [16, ·] float32 tiles are live."""
    BKP: tl.constexpr = 32 if K > 32 else K
    rI = t0 + I * BS + tl.arange(0, BS)
    rJ = t0 + J * BS + tl.arange(0, BS)
    mI = rI < eos
    mJ = rJ < eos
    tc = tl.minimum(t0 + I * BS, eos - 1)  # anchor: first row of block I
    offI = (rI[:, None] * H + i_h).to(tl.int64) * K
    offJ = (rJ[:, None] * H + i_h).to(tl.int64) * K
    offc = (tc * H + i_h).to(tl.int64) * K
    akk = tl.zeros([BS, BS], dtype=tl.float32)
    aqk = tl.zeros([BS, BS], dtype=tl.float32)
    for kk in tl.static_range(0, K, BKP):
        cols = kk + tl.arange(0, BKP)
        gc = tl.load(G + offc + cols)
        gI = tl.load(G + offI + cols[None, :], mask=mI[:, None], other=0.)
        gJ = tl.load(G + offJ + cols[None, :], mask=mJ[:, None], other=0.)
        eI = tl.where(mI[:, None], tl.exp(gI - gc[None, :]), 0.)
        eJ = tl.where(mJ[:, None], tl.exp(gc[None, :] - gJ), 0.)
        kcol = tl.trans(tl.load(k + offJ + cols[None, :], mask=mJ[:, None], other=0.).to(tl.float32) * eJ)
        akk += tl.dot(tl.load(k + offI + cols[None, :], mask=mI[:, None], other=0.).to(tl.float32) * eI, kcol)
        aqk += tl.dot(tl.load(q + offI + cols[None, :], mask=mI[:, None], other=0.).to(tl.float32) * eI, kcol)
    return akk, aqk


@triton.jit
def _inv_unit_lower(A, BS: tl.constexpr):
    """(I + A)⁻¹ for a strictly lower-triangular [BS, BS] block, by forward substitution (exact zeros above)."""
    r = tl.arange(0, BS)
    X = (r[:, None] == r[None, :]).to(tl.float32)
    for i in range(1, BS):
        a = tl.sum(tl.where(r[:, None] == i, A, 0.), 0)  # row i of A, indexed by column
        xi = tl.sum(a[:, None] * X, 0)  # Σ_j a_j X_j
        X = tl.where(r[:, None] == i, X - xi[None, :], X)
    return X


@triton.jit
def _store_blk(ptr, x, t0, eos, i_h, I: tl.constexpr, J: tl.constexpr, H: tl.constexpr, BT: tl.constexpr,
               BS: tl.constexpr):
    rI = t0 + I * BS + tl.arange(0, BS)
    cJ = J * BS + tl.arange(0, BS)
    off = (rI[:, None] * H + i_h).to(tl.int64) * BT + cJ[None, :]
    tl.store(ptr + off, x, mask=(rI < eos)[:, None])


@triton.jit
def _masked(akk, aqk, beta_I, scale, I: tl.constexpr, J: tl.constexpr, BS: tl.constexpr):
    akk = akk * beta_I[:, None]
    aqk = aqk * scale
    if I == J:
        r = tl.arange(0, BS)
        akk = tl.where(r[:, None] > r[None, :], akk, 0.)
        aqk = tl.where(r[:, None] >= r[None, :], aqk, 0.)
    return akk, aqk


@triton.jit
def _wu_src(k, v, G, beta, t0, eos, i_h, J: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
            V: tl.constexpr, BS: tl.constexpr):
    """(β⊙k⊙Γ, β⊙v) for sub-chunk J, float32."""
    rJ = t0 + J * BS + tl.arange(0, BS)
    mJ = rJ < eos
    b = tl.load(beta + rJ * H + i_h, mask=mJ, other=0.).to(tl.float32)
    gam = tl.where(mJ[:, None], tl.exp(_tile(G, rJ, mJ, i_h, H, K)), 0.)
    return _tile(k, rJ, mJ, i_h, H, K) * gam * b[:, None], _tile(v, rJ, mJ, i_h, H, V) * b[:, None]


@autotune(configs=_INTRA_CONFIGS, key=['H', 'K', 'V'])
@triton.jit
def _intra_fwd_kernel(q, k, v, G, beta, Aqk, Mb, w, u, kg, chunk_idx, cu_seqlens, scale,
                      H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = chunk_bounds(chunk_idx, cu_seqlens, i_c, BT)
    ar = tl.arange(0, BS)
    b0 = tl.load(beta + (t0 + ar) * H + i_h, mask=t0 + ar < eos, other=0.).to(tl.float32)
    b1 = tl.load(beta + (t0 + BS + ar) * H + i_h, mask=t0 + BS + ar < eos, other=0.).to(tl.float32)
    b2 = tl.load(beta + (t0 + 2 * BS + ar) * H + i_h, mask=t0 + 2 * BS + ar < eos, other=0.).to(tl.float32)
    b3 = tl.load(beta + (t0 + 3 * BS + ar) * H + i_h, mask=t0 + 3 * BS + ar < eos, other=0.).to(tl.float32)

    # ---- the ten lower blocks of A_kk and A_qk (four diagonal, six below) ----
    a00, q00 = _pair(q, k, G, t0, eos, i_h, 0, 0, H, K, BS)
    a00, q00 = _masked(a00, q00, b0, scale, 0, 0, BS)
    a10, q10 = _pair(q, k, G, t0, eos, i_h, 1, 0, H, K, BS)
    a10, q10 = _masked(a10, q10, b1, scale, 1, 0, BS)
    a11, q11 = _pair(q, k, G, t0, eos, i_h, 1, 1, H, K, BS)
    a11, q11 = _masked(a11, q11, b1, scale, 1, 1, BS)
    a20, q20 = _pair(q, k, G, t0, eos, i_h, 2, 0, H, K, BS)
    a20, q20 = _masked(a20, q20, b2, scale, 2, 0, BS)
    a21, q21 = _pair(q, k, G, t0, eos, i_h, 2, 1, H, K, BS)
    a21, q21 = _masked(a21, q21, b2, scale, 2, 1, BS)
    a22, q22 = _pair(q, k, G, t0, eos, i_h, 2, 2, H, K, BS)
    a22, q22 = _masked(a22, q22, b2, scale, 2, 2, BS)
    a30, q30 = _pair(q, k, G, t0, eos, i_h, 3, 0, H, K, BS)
    a30, q30 = _masked(a30, q30, b3, scale, 3, 0, BS)
    a31, q31 = _pair(q, k, G, t0, eos, i_h, 3, 1, H, K, BS)
    a31, q31 = _masked(a31, q31, b3, scale, 3, 1, BS)
    a32, q32 = _pair(q, k, G, t0, eos, i_h, 3, 2, H, K, BS)
    a32, q32 = _masked(a32, q32, b3, scale, 3, 2, BS)
    a33, q33 = _pair(q, k, G, t0, eos, i_h, 3, 3, H, K, BS)
    a33, q33 = _masked(a33, q33, b3, scale, 3, 3, BS)
    z = tl.zeros([BS, BS], dtype=tl.float32)
    _store_blk(Aqk, q00, t0, eos, i_h, 0, 0, H, BT, BS)
    _store_blk(Aqk, z, t0, eos, i_h, 0, 1, H, BT, BS)
    _store_blk(Aqk, z, t0, eos, i_h, 0, 2, H, BT, BS)
    _store_blk(Aqk, z, t0, eos, i_h, 0, 3, H, BT, BS)
    _store_blk(Aqk, q10, t0, eos, i_h, 1, 0, H, BT, BS)
    _store_blk(Aqk, q11, t0, eos, i_h, 1, 1, H, BT, BS)
    _store_blk(Aqk, z, t0, eos, i_h, 1, 2, H, BT, BS)
    _store_blk(Aqk, z, t0, eos, i_h, 1, 3, H, BT, BS)
    _store_blk(Aqk, q20, t0, eos, i_h, 2, 0, H, BT, BS)
    _store_blk(Aqk, q21, t0, eos, i_h, 2, 1, H, BT, BS)
    _store_blk(Aqk, q22, t0, eos, i_h, 2, 2, H, BT, BS)
    _store_blk(Aqk, z, t0, eos, i_h, 2, 3, H, BT, BS)
    _store_blk(Aqk, q30, t0, eos, i_h, 3, 0, H, BT, BS)
    _store_blk(Aqk, q31, t0, eos, i_h, 3, 1, H, BT, BS)
    _store_blk(Aqk, q32, t0, eos, i_h, 3, 2, H, BT, BS)
    _store_blk(Aqk, q33, t0, eos, i_h, 3, 3, H, BT, BS)

    # ---- M = (I + A_kk)⁻¹ by block forward substitution ----
    m00 = _inv_unit_lower(a00, BS)
    m11 = _inv_unit_lower(a11, BS)
    m22 = _inv_unit_lower(a22, BS)
    m33 = _inv_unit_lower(a33, BS)
    m10 = -tl.dot(m11, tl.dot(a10, m00))
    m21 = -tl.dot(m22, tl.dot(a21, m11))
    m20 = -tl.dot(m22, tl.dot(a20, m00) + tl.dot(a21, m10))
    m32 = -tl.dot(m33, tl.dot(a32, m22))
    m31 = -tl.dot(m33, tl.dot(a31, m11) + tl.dot(a32, m21))
    m30 = -tl.dot(m33, tl.dot(a30, m00) + tl.dot(a31, m10) + tl.dot(a32, m20))
    _store_blk(Mb, m00, t0, eos, i_h, 0, 0, H, BT, BS)
    _store_blk(Mb, z, t0, eos, i_h, 0, 1, H, BT, BS)
    _store_blk(Mb, z, t0, eos, i_h, 0, 2, H, BT, BS)
    _store_blk(Mb, z, t0, eos, i_h, 0, 3, H, BT, BS)
    _store_blk(Mb, m10, t0, eos, i_h, 1, 0, H, BT, BS)
    _store_blk(Mb, m11, t0, eos, i_h, 1, 1, H, BT, BS)
    _store_blk(Mb, z, t0, eos, i_h, 1, 2, H, BT, BS)
    _store_blk(Mb, z, t0, eos, i_h, 1, 3, H, BT, BS)
    _store_blk(Mb, m20, t0, eos, i_h, 2, 0, H, BT, BS)
    _store_blk(Mb, m21, t0, eos, i_h, 2, 1, H, BT, BS)
    _store_blk(Mb, m22, t0, eos, i_h, 2, 2, H, BT, BS)
    _store_blk(Mb, z, t0, eos, i_h, 2, 3, H, BT, BS)
    _store_blk(Mb, m30, t0, eos, i_h, 3, 0, H, BT, BS)
    _store_blk(Mb, m31, t0, eos, i_h, 3, 1, H, BT, BS)
    _store_blk(Mb, m32, t0, eos, i_h, 3, 2, H, BT, BS)
    _store_blk(Mb, m33, t0, eos, i_h, 3, 3, H, BT, BS)

    # ---- w = M (β k Γ), u = M (β v), per row block ----
    x0, y0 = _wu_src(k, v, G, beta, t0, eos, i_h, 0, H, K, V, BS)
    x1, y1 = _wu_src(k, v, G, beta, t0, eos, i_h, 1, H, K, V, BS)
    x2, y2 = _wu_src(k, v, G, beta, t0, eos, i_h, 2, H, K, V, BS)
    x3, y3 = _wu_src(k, v, G, beta, t0, eos, i_h, 3, H, K, V, BS)
    r0 = t0 + ar
    r1 = r0 + BS
    r2 = r1 + BS
    r3 = r2 + BS
    _store_tile(w, tl.dot(m00, x0), r0, r0 < eos, i_h, H, K)
    _store_tile(u, tl.dot(m00, y0), r0, r0 < eos, i_h, H, V)
    _store_tile(w, tl.dot(m10, x0) + tl.dot(m11, x1), r1, r1 < eos, i_h, H, K)
    _store_tile(u, tl.dot(m10, y0) + tl.dot(m11, y1), r1, r1 < eos, i_h, H, V)
    _store_tile(w, tl.dot(m20, x0) + tl.dot(m21, x1) + tl.dot(m22, x2), r2, r2 < eos, i_h, H, K)
    _store_tile(u, tl.dot(m20, y0) + tl.dot(m21, y1) + tl.dot(m22, y2), r2, r2 < eos, i_h, H, V)
    _store_tile(w, tl.dot(m30, x0) + tl.dot(m31, x1) + tl.dot(m32, x2) + tl.dot(m33, x3), r3, r3 < eos,
                i_h, H, K)
    _store_tile(u, tl.dot(m30, y0) + tl.dot(m31, y1) + tl.dot(m32, y2) + tl.dot(m33, y3), r3, r3 < eos,
                i_h, H, V)

    # ---- kg = k ⊙ exp(G_last − G): the chunk's contribution to the next state ----
    rows = t0 + tl.arange(0, BT)
    mrow = rows < eos
    glast = _row(G, tl.minimum(t0 + BT, eos) - 1, i_h, H, K)
    e = tl.where(mrow[:, None], tl.exp(glast[None, :] - _tile(G, rows, mrow, i_h, H, K)), 0.)
    _store_tile(kg, _tile(k, rows, mrow, i_h, H, K) * e, rows, mrow, i_h, H, K)


def intra_fwd(qn, kn, v, G, beta, scale, chunk_idx, cu_seqlens, NC):
    """Returns ``(Aqk, M, w, u, kg)``: Aqk, M ``[T, H, 64]`` float32 (row-major chunk blocks, zeros above
    the diagonal); w, kg ``[1, T, H, K]`` and u ``[1, T, H, V]`` in the input dtype."""
    _, T, H, K = kn.shape
    V = v.shape[-1]
    Aqk = torch.empty(T, H, BT, dtype=torch.float32, device=kn.device)
    M = torch.empty_like(Aqk)
    w = torch.empty_like(kn)
    kg = torch.empty_like(kn)
    u = torch.empty_like(v)
    if NC > 0:
        _intra_fwd_kernel[(NC, H)](qn, kn, v, G, beta, Aqk, M, w, u, kg, chunk_idx, cu_seqlens, float(scale),
                                   H=H, K=K, V=V, BT=BT, BS=BS)
    return Aqk, M, w, u, kg
