"""The three phases of our KDA intra kernel as separate kernels, to time each alone (bench_kda.py --intra-phases).

Import after ``bench_kda.kernels_without_model_registry()``. The kernels call the very jit functions the
production kernel calls (``kdamoe.kernels.kda.intra``), so the sum of the parts is comparable to the whole,
minus the overlap between phases that one kernel gets.
"""

import torch
import triton
import triton.language as tl

from kdamoe.kernels.kda import intra, prepare
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
    """{name: ms}: the whole fused prepare + intra kernel, prepare alone, then the three intra phases alone at 4 and
    8 warps (bf16, B=1, K=V=D)."""
    torch.manual_seed(0)
    mk = lambda: torch.randn(1, T, H, D, device=dev, dtype=torch.bfloat16)
    q, k, v, f = mk(), mk(), mk(), mk()
    beta = torch.rand(1, T, H, device=dev, dtype=torch.bfloat16)
    cu = torch.tensor([0, T], dtype=torch.int32, device=dev)
    ci, co, NC = prepare.chunk_table(cu, T, T)
    dtb = torch.zeros(H * D, device=dev)
    sc = D ** -0.5
    run = lambda: intra.intra_fwd(q, k, f, v, beta, None, dtb, lower_bound, sc, True, True, ci, cu, NC)
    qn, kn, rq, rk, G, Aqk, M, w, u, kg, qg = run()
    out = {"whole": bench(run),
           "prepare": bench(lambda: prepare.prepare_fwd(q, k, f, None, dtb, lower_bound, ci, cu, NC, True, True))}
    Ab = torch.empty_like(M)
    _scores[(NC, H)](qn, kn, G, beta, Aqk, Ab, ci, cu, sc, H=H, K=D, BT=BT, BS=BS)
    A0 = Ab.clone()
    for nw in (4, 8):
        out[f"scores_w{nw}"] = bench(lambda: _scores[(NC, H)](qn, kn, G, beta, Aqk, Ab, ci, cu, sc, H=H, K=D, BT=BT,
                                                              BS=BS, num_warps=nw))
        out[f"copy+solve_w{nw}"] = bench(lambda: (Ab.copy_(A0), _solve[(NC, H)](Ab, ci, cu, H=H, BT=BT, BS=BS,
                                                                                num_warps=nw)))
        out[f"wu_w{nw}"] = bench(lambda: _wu[(NC, H)](qn, kn, v, G, beta, M, w, u, kg, qg, ci, cu, sc, H=H, K=D, V=D,
                                                     BT=BT, num_warps=nw))
    out["copy"] = bench(lambda: Ab.copy_(A0))
    return {k_: round(v_, 4) for k_, v_ in out.items()}
