"""Chunk-parallel backward stages of chunked KDA.

Given h[c] (chunk-start state), dh[c] (gradient of the chunk-end state), δ and dδ from the state
passes, per chunk (same notation as ``intra.py``; Γ = exp(G), kg = k ⊙ exp(G_last − G)):

Stage ``wy`` (whole-matrix terms, no anchors needed because every exponent is ≤ 0):

    dqg = dO hᵀ                 → dq += scale·dqg⊙Γ
    dw  = −dδ hᵀ,  du = dδ       (δ = u − w h)
    dkg = δ dhᵀ                  (S_end = exp(G_last)⊙S + kgᵀδ)
    dM  = dw (β k Γ)ᵀ + du (β v)ᵀ,   d(βkΓ) = Mᵀ dw,   d(βv) = Mᵀ du
    dA_kk = −Mᵀ dM Mᵀ (strictly lower),   dA_qk = dO δᵀ (lower incl.)
    dG collects x ⊙ dx for every factor x·exp(±G) (sign of the exponent), dG_last the G_last terms.

Stage ``intra`` (pairwise terms, 16×16 blocks on tensor cores with the first-row anchor, as in
the forward): gradients of q, k, β, G through A_qk and A_kk; then dg = reverse in-chunk cumsum of dG
plus dG_last; then the L2-norm and gate backward. Outputs the final dq, dk, dβ, dg (or df) and
per-chunk partial sums for dt_bias and A_log.

Precision of the pairwise products: each pair (i, j) adds +x to dG_i (row-anchored product) and −x to
dG_j (column-anchored product); in exact arithmetic these cancel inside the reverse cumsum except across
the pair's span. With tf32 operands the two copies of x are rounded differently and the mismatch
accumulates over the chunk: measured on the H200, bf16 df error 1.1e-2 and dt_bias 7e-2 (other gradients
3–4e-3); reproduced on the CPU by rounding dot operands to tf32 (df 9.3e-3, everything else 4e-4) and
traced to this stage alone. The intra stage therefore uses ``tf32x3`` products (float32-accurate on
tensor cores); with exact products the CPU emulation gives df 3.6e-4.
"""

import torch
import triton
import triton.language as tl

from ..launch import autotune
from .intra import _exp_where, _row, _store_tile, _tile
from .prepare import BS, BT, chunk_bounds

# Shared memory of the wy stage is dominated by staging dot operands (about 80 KB for the value loop and
# 100 KB in all on triton 3.7 with input-dtype operands below); no loads are pipelined (num_stages=1).
_WY_CONFIGS = [triton.Config({'BV': 64}, num_warps=8, num_stages=1),
               triton.Config({'BV': 32}, num_warps=4, num_stages=1),
               triton.Config({'BV': 64}, num_warps=4, num_stages=1)]
# the intra gradient stage spills ~0.9 KB per thread with 4 warps, ~0.1 KB with 8 (ptxas, sm_90); capped
# registers trade spills for resident CTAs. The autotuner picks by time; the CPU interpreter runs the first
# config of each list (kdamoe.kernels.utils.autotune).
_BWD_INTRA_CONFIGS = [triton.Config({}, num_warps=4), triton.Config({}, num_warps=8),
                      triton.Config({}, num_warps=4, maxnreg=128), triton.Config({}, num_warps=8, maxnreg=128)]


@autotune(configs=_WY_CONFIGS, key=['H', 'K', 'V'])
@triton.jit
def _bwd_wy_kernel(qn, kn, v, G, beta, Mb, h, dh, vnew, dvnew, do, dAqk, dAkk, dqd, dkd, dGd, dbd, dgl, dv,
                   chunk_idx, cu_seqlens, scale,
                   H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = chunk_bounds(chunk_idx, cu_seqlens, i_c, BT)
    rows = t0 + tl.arange(0, BT)
    mrow = rows < eos
    tok = (rows * H + i_h).to(tl.int64)
    ck = tl.arange(0, K)
    ct = tl.arange(0, BT)
    m2 = mrow[:, None]
    # Products take input-dtype operands, except with a head dim under 32: fp16 operands at K = 16, V = 32 hit
    # an illegal memory access on the H200 with triton 3.6 (float32 ones did not); float32 (tf32) there.
    dt = vnew.dtype.element_ty if (K >= 32 and V >= 32) else tl.float32
    b_k = _tile(kn, rows, mrow, i_h, H, K)
    b_G = _tile(G, rows, mrow, i_h, H, K)
    b_b = tl.load(beta + rows * H + i_h, mask=mrow, other=0.).to(tl.float32)
    gam = tl.where(m2, tl.exp(b_G), 0.)
    bkg = b_k * gam * b_b[:, None]
    moff = tok[:, None] * BT + ct[None, :]
    b_M = tl.load(Mb + moff, mask=m2 & (ct[None, :] <= ct[:, None]), other=0.)

    dqg = tl.zeros([BT, K], dtype=tl.float32)
    dw = tl.zeros([BT, K], dtype=tl.float32)
    dkg = tl.zeros([BT, K], dtype=tl.float32)
    dglh = tl.zeros([K], dtype=tl.float32)
    dAq = tl.zeros([BT, BT], dtype=tl.float32)
    dMv = tl.zeros([BT, BT], dtype=tl.float32)
    db = tl.zeros([BT], dtype=tl.float32)
    hbase = (i_c * H + i_h).to(tl.int64) * K * V
    # M in the input dtype for the value-side products (tensor cores; the bf16 rounding of M costs ~2e-3)
    b_Mh = b_M.to(dt)
    for i_v in range(tl.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        mv = cv < V
        mtv = m2 & mv[None, :]
        voff = tok[:, None] * V + cv[None, :]
        b_h = tl.load(h + hbase + ck[:, None] * V + cv[None, :], mask=mv[None, :], other=0.).to(dt)
        b_dh = tl.load(dh + hbase + ck[:, None] * V + cv[None, :], mask=mv[None, :], other=0.).to(dt)
        b_d = tl.load(vnew + voff, mask=mtv, other=0.).to(dt)
        b_dd = tl.load(dvnew + voff, mask=mtv, other=0.).to(dt)
        b_do = tl.load(do + voff, mask=mtv, other=0.).to(dt)
        b_v = tl.load(v + voff, mask=mtv, other=0.).to(tl.float32)
        dqg += tl.dot(b_do, tl.trans(b_h))
        dw -= tl.dot(b_dd, tl.trans(b_h))
        dkg += tl.dot(b_d, tl.trans(b_dh))
        dglh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), 1)
        dAq += tl.dot(b_do, tl.trans(b_d))
        dMv += tl.dot(b_dd, tl.trans((b_v * b_b[:, None]).to(dt)))
        dbv = tl.dot(tl.trans(b_Mh), b_dd)
        tl.store(dv + voff, (dbv * b_b[:, None]).to(dv.dtype.element_ty), mask=mtv)
        db += tl.sum(dbv * b_v, 1)
    dM = dMv + tl.dot(dw.to(dt), tl.trans(bkg.to(dt)))
    dbkg = tl.dot(tl.trans(b_Mh), dw.to(dt))
    dA = -tl.dot(tl.dot(tl.trans(b_M), dM), tl.trans(b_M))
    dA = tl.where(ct[:, None] > ct[None, :], dA, 0.)
    dAq = tl.where(ct[:, None] >= ct[None, :], dAq, 0.)
    tl.store(dAqk + moff, dAq, mask=m2)
    tl.store(dAkk + moff, dA, mask=m2)

    b_q = _tile(qn, rows, mrow, i_h, H, K)
    dq = dqg * gam * scale
    dG = dq * b_q
    dk = dbkg * b_b[:, None] * gam
    db += tl.sum(dbkg * b_k * gam, 1)
    dG += dbkg * bkg
    glast = _row(G, tl.minimum(t0 + BT, eos) - 1, i_h, H, K)
    ekg = tl.where(m2, tl.exp(glast[None, :] - b_G), 0.)
    kgv = b_k * ekg
    dk += dkg * ekg
    dG -= dkg * kgv
    tl.store(dgl + (i_c * H + i_h).to(tl.int64) * K + ck, tl.exp(glast) * dglh + tl.sum(dkg * kgv, 0))
    _store_tile(dqd, dq, rows, mrow, i_h, H, K)
    _store_tile(dkd, dk, rows, mrow, i_h, H, K)
    _store_tile(dGd, dG, rows, mrow, i_h, H, K)
    tl.store(dbd + rows * H + i_h, db, mask=mrow)


def bwd_wy(qn, kn, v, G, beta, M, h, dh, vnew, dvnew, do, scale, chunk_idx, cu_seqlens, NC):
    _, T, H, K = kn.shape
    V = v.shape[-1]
    f32 = dict(dtype=torch.float32, device=kn.device)
    dAqk = torch.empty(T, H, BT, **f32)
    dAkk = torch.empty(T, H, BT, **f32)
    dqd = torch.empty(kn.shape, **f32)
    dkd = torch.empty(kn.shape, **f32)
    dGd = torch.empty(kn.shape, **f32)
    dbd = torch.empty(T, H, **f32)
    dgl = torch.empty(max(NC, 1), H, K, **f32)
    dv = torch.empty_like(v)
    if NC > 0:
        _bwd_wy_kernel[(NC, H)](qn, kn, v, G, beta, M, h, dh, vnew, dvnew, do, dAqk, dAkk, dqd, dkd, dGd, dbd,
                                dgl, dv, chunk_idx, cu_seqlens, float(scale), H=H, K=K, V=V, BT=BT)
    return dAqk, dAkk, dqd, dkd, dGd, dbd, dgl, dv


@autotune(configs=_BWD_INTRA_CONFIGS, key=['H', 'K', 'USE_L2', 'GATE_IN'])
@triton.jit
def _bwd_intra_kernel(qn, kn, G, beta, dAqk, dAkk, dqd, dkd, dGd, dbd, dgl, rq, rk, f, A_log, dt_bias,
                      dq, dk, dg, dbeta, ddtb_part, dA_part, chunk_idx, cu_seqlens, scale, lower_bound,
                      H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
                      USE_L2: tl.constexpr, GATE_IN: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr,
                      PREC: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = chunk_bounds(chunk_idx, cu_seqlens, i_c, BT)
    ar = tl.arange(0, BS)
    ck = tl.arange(0, K)
    NS: tl.constexpr = BT // BS
    carry = tl.load(dgl + (i_c * H + i_h).to(tl.int64) * K + ck)
    if GATE_IN:
        if HAS_A:
            ea = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        else:
            ea = 1.0
        if HAS_BIAS:
            bias = tl.load(dt_bias + i_h * K + ck).to(tl.float32)
        else:
            bias = tl.zeros([K], dtype=tl.float32)
    dbias = tl.zeros([K], dtype=tl.float32)
    dalog = tl.zeros([K], dtype=tl.float32)
    for ii in range(NS):
        I = NS - 1 - ii
        rI = t0 + I * BS + ar
        mI = rI < eos
        gc = _row(G, tl.minimum(t0 + I * BS, eos - 1), i_h, H, K)  # anchor: first row of block I
        b_q = _tile(qn, rI, mI, i_h, H, K)
        b_k = _tile(kn, rI, mI, i_h, H, K)
        b_G = _tile(G, rI, mI, i_h, H, K)
        b_b = tl.load(beta + rI * H + i_h, mask=mI, other=0.).to(tl.float32)
        eI = _exp_where(mI[:, None], b_G - gc[None, :])
        # rows of block I against columns J ≤ I
        accq = tl.zeros([BS, K], dtype=tl.float32)
        accr = tl.zeros([BS, K], dtype=tl.float32)
        for J in range(0, I + 1):
            rJ = t0 + J * BS + ar
            mJ = rJ < eos
            eJ = _exp_where(mJ[:, None], gc[None, :] - _tile(G, rJ, mJ, i_h, H, K))
            kc = _tile(kn, rJ, mJ, i_h, H, K) * eJ
            boff = (rI[:, None] * H + i_h).to(tl.int64) * BT + J * BS + ar[None, :]
            accq += tl.dot(tl.load(dAqk + boff, mask=mI[:, None], other=0.), kc, input_precision=PREC)
            accr += tl.dot(tl.load(dAkk + boff, mask=mI[:, None], other=0.), kc, input_precision=PREC)
        dq_row = accq * eI * scale
        R = accr * eI
        # block I as columns against rows of blocks J2 ≥ I (same anchor: every such row is at or after it)
        accc = tl.zeros([BS, K], dtype=tl.float32)
        for J2 in range(I, NS):
            r2 = t0 + J2 * BS + ar
            m2 = r2 < eos
            e2 = _exp_where(m2[:, None], _tile(G, r2, m2, i_h, H, K) - gc[None, :])
            b2 = tl.load(beta + r2 * H + i_h, mask=m2, other=0.).to(tl.float32)
            boff2 = (r2[:, None] * H + i_h).to(tl.int64) * BT + I * BS + ar[None, :]
            dq2 = tl.load(dAqk + boff2, mask=m2[:, None], other=0.)
            da2 = tl.load(dAkk + boff2, mask=m2[:, None], other=0.) * b2[:, None]
            accc += tl.dot(tl.trans(dq2), _tile(qn, r2, m2, i_h, H, K) * e2 * scale, input_precision=PREC)
            accc += tl.dot(tl.trans(da2), _tile(kn, r2, m2, i_h, H, K) * e2, input_precision=PREC)
        dk_col = accc * _exp_where(mI[:, None], gc[None, :] - b_G)
        dk_row = R * b_b[:, None]
        b_dq = _tile(dqd, rI, mI, i_h, H, K) + dq_row
        b_dk = _tile(dkd, rI, mI, i_h, H, K) + dk_row + dk_col
        b_db = tl.load(dbd + rI * H + i_h, mask=mI, other=0.) + tl.sum(b_k * R, 1)
        dG = _tile(dGd, rI, mI, i_h, H, K) + b_q * dq_row + b_k * dk_row - b_k * dk_col
        # reverse cumulative sum inside the chunk (G = cumsum g), plus everything after block I
        tot = tl.sum(dG, 0)
        dgi = tl.where(mI[:, None], tot[None, :] - tl.cumsum(dG, 0) + dG + carry[None, :], 0.)
        carry += tot
        if USE_L2:
            r_q = tl.load(rq + rI * H + i_h, mask=mI, other=0.)
            b_dq = r_q[:, None] * (b_dq - b_q * tl.sum(b_q * b_dq, 1)[:, None])
            r_k = tl.load(rk + rI * H + i_h, mask=mI, other=0.)
            b_dk = r_k[:, None] * (b_dk - b_k * tl.sum(b_k * b_dk, 1)[:, None])
        _store_tile(dq, b_dq, rI, mI, i_h, H, K)
        _store_tile(dk, b_dk, rI, mI, i_h, H, K)
        tl.store(dbeta + rI * H + i_h, b_db.to(dbeta.dtype.element_ty), mask=mI)
        if GATE_IN:
            x = (_tile(f, rI, mI, i_h, H, K) + bias[None, :]) * ea
            sg = tl.sigmoid(x)
            dx = tl.where(mI[:, None], dgi * lower_bound * sg * (1. - sg), 0.)
            _store_tile(dg, dx * ea, rI, mI, i_h, H, K)
            dbias += tl.sum(dx, 0) * ea
            dalog += tl.sum(dx * x, 0)
        else:
            _store_tile(dg, dgi, rI, mI, i_h, H, K)
    if GATE_IN:
        tl.store(ddtb_part + (i_c * H + i_h).to(tl.int64) * K + ck, dbias)
        tl.store(dA_part + (i_c * H + i_h).to(tl.int64) * K + ck, dalog)


def bwd_intra(qn, kn, G, beta, dAqk, dAkk, dqd, dkd, dGd, dbd, dgl, rq, rk, f, A_log, dt_bias, scale, lower_bound,
              chunk_idx, cu_seqlens, NC, q_dtype, k_dtype, g_dtype, use_l2, gate_in):
    """Returns ``(dq, dk, dg, dbeta, ddt_bias_part, dA_log_part)``; dg is df when the gate is in the kernel;
    the two partial sums are ``[NC, H, K]`` float32 (None without the in-kernel gate)."""
    _, T, H, K = kn.shape
    dq = torch.empty(kn.shape, dtype=q_dtype, device=kn.device)
    dk = torch.empty(kn.shape, dtype=k_dtype, device=kn.device)
    dg = torch.empty(kn.shape, dtype=g_dtype, device=kn.device)
    dbeta = torch.empty(T, H, dtype=beta.dtype, device=kn.device)
    ddtb = dAl = None
    if gate_in:
        ddtb = torch.empty(max(NC, 1), H, K, dtype=torch.float32, device=kn.device)
        dAl = torch.empty_like(ddtb)
    if NC > 0:
        _bwd_intra_kernel[(NC, H)](qn, kn, G, beta, dAqk, dAkk, dqd, dkd, dGd, dbd, dgl, rq, rk, f, A_log, dt_bias,
                                   dq, dk, dg, dbeta, ddtb, dAl, chunk_idx, cu_seqlens, float(scale),
                                   float(lower_bound), H=H, K=K, BT=BT, BS=BS, USE_L2=use_l2, GATE_IN=gate_in,
                                   HAS_A=A_log is not None, HAS_BIAS=dt_bias is not None, PREC="tf32x3")
    if gate_in and NC == 0:
        ddtb.zero_()
        dAl.zero_()
    return dq, dk, dg, dbeta, ddtb, dAl
