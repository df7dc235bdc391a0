"""The three phases of our KDA intra kernel as separate kernels, to time each alone (bench_kda.py --intra-phases).

Import after ``harness.kernels_only()`` (``bench_kda.py`` calls it first). The kernels call the very jit functions the
production kernel calls (``kdamoe.kernels.kda.intra``), so the sum of the parts is comparable to the whole,
minus the overlap between phases that one kernel gets.
"""

import torch
import triton
import triton.language as tl

from kdamoe.kernels.kda import intra, prepare
from kdamoe.kernels.kda.intra import _exp_where, _store_scores
from kdamoe.kernels.kda.prepare import BS, BT, chunk_bounds


@triton.jit
def _scores(q, k, G, beta, Aqk, Mb, chunk_idx, cu_seqlens, scale, H: tl.constexpr, K: tl.constexpr,
            BT: tl.constexpr, BS: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = chunk_bounds(chunk_idx, cu_seqlens, i_c, BT)
    BK: tl.constexpr = 32 if K > 32 else K
    intra._row_block_scores(q, k, G, beta, Aqk, Mb, t0, eos, i_h, scale, 0, H, K, BT, BS, BK)
    intra._row_block_scores(q, k, G, beta, Aqk, Mb, t0, eos, i_h, scale, 1, H, K, BT, BS, BK)
    intra._row_block_scores(q, k, G, beta, Aqk, Mb, t0, eos, i_h, scale, 2, H, K, BT, BS, BK)
    intra._row_block_scores(q, k, G, beta, Aqk, Mb, t0, eos, i_h, scale, 3, H, K, BT, BS, BK)


@triton.jit
def _block_products(q, k, G, R, Ga, ga0, ga1, ga2, ga3, akk, aqk, t0, eos, i_h, cols,
                    I: tl.constexpr,  # noqa: E741  (the row block I of the docstring's math)
                    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr):
    """One key slice's contribution to row block I: left rows k_i, q_i ⊙ exp(G_i − G_cI), right columns
    R_j ⊙ exp(G_cI − G_c(j)), the last factor a [BK] vector per column block (no [64, BK] exponentials)."""
    rI = t0 + I * BS + tl.arange(0, BS)
    mI = rI < eos
    offI = (rI[:, None] * H + i_h).to(tl.int64) * K + cols[None, :]
    gc = ga0 if I == 0 else (ga1 if I == 1 else (ga2 if I == 2 else ga3))
    eI = _exp_where(mI[:, None], tl.load(G + offI, mask=mI[:, None], other=0.) - gc[None, :])
    blk = tl.arange(0, BT) // BS
    f = tl.where(blk[:, None] == 0, tl.exp(gc - ga0)[None, :], 0.)
    if I >= 1:
        f = tl.where(blk[:, None] == 1, tl.exp(gc - ga1)[None, :], f)
    if I >= 2:
        f = tl.where(blk[:, None] == 2, tl.exp(gc - ga2)[None, :], f)
    if I >= 3:
        f = tl.where(blk[:, None] == 3, tl.exp(gc - ga3)[None, :], f)
    right = tl.trans(R * f)
    akk += tl.dot(tl.load(k + offI, mask=mI[:, None], other=0.).to(tl.float32) * eI, right)
    aqk += tl.dot(tl.load(q + offI, mask=mI[:, None], other=0.).to(tl.float32) * eI, right)
    return akk, aqk


@triton.jit
def _scores_sliced(q, k, G, beta, Aqk, Ab, chunk_idx, cu_seqlens, scale, H: tl.constexpr, K: tl.constexpr,
                   BT: tl.constexpr, BS: tl.constexpr):
    """Candidate for phase 1 (not used by the library): the key slice is the outer loop, so the chunk's G and k
    are read once per slice instead of once per row block, and the right operand is factored as
    R_j = k_j ⊙ exp(G_c(j) − G_j) (c(j) the first row of j's block; exponent in [0, 75]) times
    exp(G_cI − G_c(j)) ≤ 1, a vector per pair of blocks. Same masks and stores as the library's phase 1."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = chunk_bounds(chunk_idx, cu_seqlens, i_c, BT)
    BK: tl.constexpr = 32 if K > 32 else K
    ct = tl.arange(0, BT)
    rows = t0 + ct
    mrow = rows < eos
    tok = (rows * H + i_h).to(tl.int64)
    atok = (tl.minimum(t0 + (ct // BS) * BS, eos - 1) * H + i_h).to(tl.int64)
    a0 = ((tl.minimum(t0, eos - 1)) * H + i_h).to(tl.int64) * K
    a1 = ((tl.minimum(t0 + BS, eos - 1)) * H + i_h).to(tl.int64) * K
    a2 = ((tl.minimum(t0 + 2 * BS, eos - 1)) * H + i_h).to(tl.int64) * K
    a3 = ((tl.minimum(t0 + 3 * BS, eos - 1)) * H + i_h).to(tl.int64) * K
    k0 = tl.zeros([BS, BT], dtype=tl.float32)
    q0 = tl.zeros([BS, BT], dtype=tl.float32)
    k1 = tl.zeros([BS, BT], dtype=tl.float32)
    q1 = tl.zeros([BS, BT], dtype=tl.float32)
    k2 = tl.zeros([BS, BT], dtype=tl.float32)
    q2 = tl.zeros([BS, BT], dtype=tl.float32)
    k3 = tl.zeros([BS, BT], dtype=tl.float32)
    q3 = tl.zeros([BS, BT], dtype=tl.float32)
    for kk in range(0, K, BK):
        cols = kk + tl.arange(0, BK)
        Gs = tl.load(G + tok[:, None] * K + cols[None, :], mask=mrow[:, None], other=0.)
        Ga = tl.load(G + atok[:, None] * K + cols[None, :])
        R = tl.load(k + tok[:, None] * K + cols[None, :], mask=mrow[:, None], other=0.).to(tl.float32) \
            * _exp_where(mrow[:, None], Ga - Gs)
        ga0 = tl.load(G + a0 + cols)
        ga1 = tl.load(G + a1 + cols)
        ga2 = tl.load(G + a2 + cols)
        ga3 = tl.load(G + a3 + cols)
        k0, q0 = _block_products(q, k, G, R, Ga, ga0, ga1, ga2, ga3, k0, q0, t0, eos, i_h, cols, 0, H, K, BT, BS)
        k1, q1 = _block_products(q, k, G, R, Ga, ga0, ga1, ga2, ga3, k1, q1, t0, eos, i_h, cols, 1, H, K, BT, BS)
        k2, q2 = _block_products(q, k, G, R, Ga, ga0, ga1, ga2, ga3, k2, q2, t0, eos, i_h, cols, 2, H, K, BT, BS)
        k3, q3 = _block_products(q, k, G, R, Ga, ga0, ga1, ga2, ga3, k3, q3, t0, eos, i_h, cols, 3, H, K, BT, BS)
    _store_scores(Aqk, Ab, k0, q0, beta, t0, eos, i_h, scale, 0, H, BT, BS)
    _store_scores(Aqk, Ab, k1, q1, beta, t0, eos, i_h, scale, 1, H, BT, BS)
    _store_scores(Aqk, Ab, k2, q2, beta, t0, eos, i_h, scale, 2, H, BT, BS)
    _store_scores(Aqk, Ab, k3, q3, beta, t0, eos, i_h, scale, 3, H, BT, BS)


@triton.jit
def _solve(Mb, chunk_idx, cu_seqlens, H: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = chunk_bounds(chunk_idx, cu_seqlens, i_c, BT)
    intra._solve(Mb, t0, eos, i_h, H, BT, BS)


@triton.jit
def _wu(q, k, v, G, beta, Mb, w, u, kg, qg, chunk_idx, cu_seqlens, scale, H: tl.constexpr, K: tl.constexpr,
        V: tl.constexpr, BT: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = chunk_bounds(chunk_idx, cu_seqlens, i_c, BT)
    intra._wu_kg_qg(q, k, v, G, beta, Mb, w, u, kg, qg, t0, eos, i_h, scale, H, K, V, BT)


def phase_times(T, H, D, dev, bench, lower_bound):
    """{name: ms}: the whole fused prepare + intra kernel, prepare alone, the three intra phases alone at 4 and
    8 warps, then the phase-1 candidate ``_scores_sliced`` (its relative difference to the library's phase 1,
    and its time). bf16, B=1, K=V=D."""
    torch.manual_seed(0)

    def mk():
        return torch.randn(1, T, H, D, device=dev, dtype=torch.bfloat16)

    q, k, v, f = mk(), mk(), mk(), mk()
    beta = torch.rand(1, T, H, device=dev, dtype=torch.bfloat16)
    cu = torch.tensor([0, T], dtype=torch.int32, device=dev)
    ci, co, NC = prepare.chunk_table(cu, T, T)
    dtb = torch.zeros(H * D, device=dev)
    sc = D ** -0.5

    def run():
        return intra.intra_fwd(q, k, f, v, beta, None, dtb, lower_bound, sc, True, True, ci, cu, NC)

    qn, kn, rq, rk, G, Aqk, M, w, u, kg, qg = run()
    out = {"whole": bench(run),
           "prepare": bench(lambda: prepare.prepare_fwd(q, k, f, None, dtb, lower_bound, ci, cu, NC, True, True))}
    Ab = torch.empty_like(M)
    _scores[(NC, H)](qn, kn, G, beta, Aqk, Ab, ci, cu, sc, H=H, K=D, BT=BT, BS=BS)
    A0 = Ab.clone()
    for nw in (4, 8):
        out[f"scores_w{nw}"] = bench(lambda nw=nw: _scores[(NC, H)](qn, kn, G, beta, Aqk, Ab, ci, cu, sc, H=H, K=D,
                                                                    BT=BT, BS=BS, num_warps=nw))
        out[f"copy+solve_w{nw}"] = bench(lambda nw=nw: (Ab.copy_(A0), _solve[(NC, H)](Ab, ci, cu, H=H, BT=BT, BS=BS,
                                                                                      num_warps=nw)))
        out[f"wu_w{nw}"] = bench(lambda nw=nw: _wu[(NC, H)](qn, kn, v, G, beta, M, w, u, kg, qg, ci, cu, sc, H=H, K=D,
                                                           V=D, BT=BT, num_warps=nw))
    out["copy"] = bench(lambda: Ab.copy_(A0))
    # the phase-1 candidate: same outputs (lower triangle; the library leaves some upper entries unwritten)?
    Aqk2, Ab2 = torch.zeros_like(Aqk), torch.zeros_like(Ab)
    _scores_sliced[(NC, H)](qn, kn, G, beta, Aqk2, Ab2, ci, cu, sc, H=H, K=D, BT=BT, BS=BS)
    _scores[(NC, H)](qn, kn, G, beta, Aqk, Ab, ci, cu, sc, H=H, K=D, BT=BT, BS=BS)
    low = torch.ones(BT, BT, device=dev).tril().bool()
    rows = torch.arange(T, device=dev) % BT
    lq, lk = low[rows][:, None, :], low[rows][:, None, :] & ~torch.eye(BT, device=dev).bool()[rows][:, None, :]

    def z(x, m):
        return torch.where(m, x.float(), 0.)

    def d(a, b, m):
        return (z(a, m) - z(b, m)).norm().item() / max(z(b, m).norm().item(), 1e-30)

    out["sliced_vs_library_rel_Aqk"] = d(Aqk2, Aqk, lq)
    out["sliced_vs_library_rel_Akk"] = d(Ab2, Ab, lk)
    for nw, reg in ((4, None), (4, 128), (8, None)):
        out[f"scores_sliced_w{nw}" + (f"_r{reg}" if reg else "")] = bench(
            lambda nw=nw, reg=reg: _scores_sliced[(NC, H)](qn, kn, G, beta, Aqk2, Ab2, ci, cu, sc, H=H, K=D, BT=BT,
                                                           BS=BS, num_warps=nw, maxnreg=reg))
    return {k_: (round(v_, 4) if v_ > 1e-3 else v_) for k_, v_ in out.items()}
