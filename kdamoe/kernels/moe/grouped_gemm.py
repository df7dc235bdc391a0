"""Grouped GEMM kernels for routed experts (rows grouped by expert, see ``permute.py``).

Row ``r`` of the sorted order is one (token, slot) pair ``flat = order[r]`` (``flat = t·k + j``) routed to
expert ``e``; experts own the contiguous row ranges ``row_offs[e] : row_offs[e+1]``. A row tile of
``BM`` rows never straddles two experts: ``tile_offs[e] = Σ_{e'<e} ceil(count_e'/BM)`` and each program
reads its expert from ``tile_expert`` (a searchsorted over ``tile_offs``; no host synchronisation,
zero-token experts own zero tiles). Tokens are gathered by index inside the A-operand loads, so no permuted copy of the
activations is ever written.

Kernels (per expert e, W1 = gate_up_proj[e] [2I, ℓ], W2 = down_proj[e] [ℓ, I]):
  gate_up_fwd : h = x[tok] @ W1ᵀ, g_w = w · GLU(h[:, :I], h[:, I:])     (activation and routing weight in the
                epilogue)
  rows_gemm   : C = A[rows] @ B_e, stored at row ``flat`` (forward down projection y = g_w @ W2ᵀ, already weighted;
                backward ∂x per slot) or at the sorted row (backward ∂g' = ∂out[tok] @ W2, unweighted)
  glu_rows_bwd: per sorted row, ∂h = GLU'(h)·(w·∂g') and ∂w = Σ_i ∂g'_i · g_i (element-wise, after rows_gemm;
                g recomputed from h)
  wgrad       : ∂W_e = Σ_{r∈e} A[r]ᵀ B[r]   (K loop over the expert's rows; experts from a list; ∂W2 takes g_w as B,
                so no operand is rescaled inside the loop)
  combine     : out[t] = Σ_{j: index[t,j] < E} Y[t·k + j]
Sources: LatentMoE (arXiv:2601.18089) for the expert layout; Kimi K3 report §2.3 for SiTU-GLU.
"""

import triton
import triton.language as tl

from ..launch import autotune, fast_launch
from .activation import glu_backward, glu_forward


def _cfgs(gpu):
    """``triton.Config`` list from ``(kwargs, num_warps, num_stages)``; the first one is also the CPU
    interpreter's (``kdamoe.kernels.utils.autotune``)."""
    return [triton.Config(c, num_warps=w, num_stages=s) for c, w, s in gpu]


# ----------------------------------------------------------------------------------------------
# forward: gate/up projection with the GLU activation in the epilogue
# ----------------------------------------------------------------------------------------------
# One B tile holds 2·BN weight rows, the BN gate rows n0 … n0+BN−1 then the BN up rows I+n0 …, so one dot of width
# 2·BN fills one accumulator with both halves. Two dots of width BN into two accumulators (the kernel before) held the
# same registers but issued two streams of narrower MMAs, and ran at 402-409 TFLOP/s on the H200 at the e2e shape
# (128 x 2·128 x 64, 8 warps; benchmarks/results/moe_rows_tune_h200.md) against 515-610 for the plain row GEMMs.
# With one accumulator (128 registers per thread at BN = 64 and 8 warps, against 255) the 15 calls of a 32K step took
# 20.0 ms against 21.4 (about 410 TFLOP/s; e2e runs at 80d5d19 and ee44576, in git history), still short of the
# row GEMMs.
@autotune(
    configs=_cfgs([({"BN": 64, "BK": 64}, 8, 3), ({"BN": 64, "BK": 64}, 8, 4), ({"BN": 128, "BK": 64}, 8, 3),
                   ({"BN": 64, "BK": 64}, 4, 4)]),
    key=["I", "L", "BM"],
)
@triton.jit
def _gate_up_fwd_kernel(
    x_ptr, w_ptr, order_ptr, tile_expert_ptr, tile_offs_ptr, row_offs_ptr, rw_ptr, g_ptr, h_ptr,
    E, I, L, beta1, beta2,
    TOPK: tl.constexpr, ACT: tl.constexpr, SAVE_H: tl.constexpr, PREC: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n = (I + BN - 1) // BN
    tile = pid // num_n
    pid_n = pid % num_n
    # tile_expert[tile] = e with tile_offs[e] <= tile < tile_offs[e+1] (E past the last tile); written inline
    # because a nested jit call costs milliseconds per program under the CPU interpreter
    e = tl.load(tile_expert_ptr + tile)
    if e < E:
        row_start = tl.load(row_offs_ptr + e) + (tile - tl.load(tile_offs_ptr + e)) * BM
        row_end = tl.load(row_offs_ptr + e + 1)
        rows = row_start + tl.arange(0, BM)
        rmask = rows < row_end
        flat = tl.load(order_ptr + rows, mask=rmask, other=0)
        tok = (flat // TOPK).to(tl.int64)
        # column c of the 2·BN-wide tile: gate column n0 + c (c < BN), up column n0 + c − BN (c ≥ BN), i.e. weight
        # row ``wrow`` and h column ``wrow`` (h = [gate | up])
        offs_c = tl.arange(0, 2 * BN)
        col = pid_n * BN + offs_c % BN
        cmask = col < I
        wrow = col + (offs_c // BN) * I
        offs_k = tl.arange(0, BK)
        a_ptrs = x_ptr + tok[:, None] * L + offs_k[None, :]
        b_ptrs = w_ptr + e.to(tl.int64) * (2 * I * L) + wrow[None, :].to(tl.int64) * L + offs_k[:, None]
        acc = tl.zeros((BM, 2 * BN), dtype=tl.float32)
        for k0 in range(0, L, BK):
            kmask = (k0 + offs_k) < L
            a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[:, None] & cmask[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PREC)
            a_ptrs += BK
            b_ptrs += BK
        rows64 = rows.to(tl.int64)
        if SAVE_H:
            tl.store(h_ptr + rows64[:, None] * (2 * I) + wrow[None, :], acc.to(h_ptr.dtype.element_ty),
                     mask=rmask[:, None] & cmask[None, :])
        acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN)), (0, 2, 1)))
        # the routing weight of the slot, applied here once per row: the down projection then needs no scaling, and
        # the ∂W2 GEMM reads g_w as its B operand as it is (a rescaled operand inside its K loop cost a third of its
        # throughput on the H200: 273 against 367 TFLOP/s for ∂W1, benchmarks/results/e2e_h200.md at 193d245)
        rw = tl.load(rw_ptr + flat, mask=rmask, other=0.0).to(tl.float32)
        g = glu_forward(acc_g, acc_u, ACT, beta1, beta2) * rw[:, None]
        offs_n = pid_n * BN + tl.arange(0, BN)
        tl.store(g_ptr + rows64[:, None] * I + offs_n[None, :], g.to(g_ptr.dtype.element_ty),
                 mask=rmask[:, None] & (offs_n < I)[None, :])


# ----------------------------------------------------------------------------------------------
# C = A[rows] @ B_e, stored at the slot (SORTED_OUT = False) or at the sorted row (SORTED_OUT = True)
# ----------------------------------------------------------------------------------------------
# The backward's ∂g' = ∂out[tok] @ W2 once carried the GLU derivative and the ∂w row sums in its epilogue. On the
# H200 at the e2e shape (benchmarks/results/moe_rows_tune_h200.md) that epilogue (two h tiles, the derivative, the
# row sums on top of the accumulator) spilled in every config but BN = 64 / 8 warps and ran at 127 TFLOP/s at best
# (2.16 ms), against 430-620 TFLOP/s for the same GEMM shape with a plain store; the derivative now runs in
# ``_glu_rows_bwd_kernel``, an element-wise pass over the stored ∂g' (0.27 GB more traffic per layer at 32K tokens).
@autotune(
    configs=_cfgs([({"BN": 128, "BK": 64}, 8, 3), ({"BN": 128, "BK": 32}, 4, 4), ({"BN": 256, "BK": 64}, 8, 3),
                   ({"BN": 128, "BK": 64}, 8, 4), ({"BN": 64, "BK": 64}, 8, 4)]),
    key=["N_OUT", "K_DIM", "BM", "SORTED_OUT"],
)
@triton.jit
def _rows_gemm_kernel(
    a_ptr, b_ptr, order_ptr, tile_expert_ptr, tile_offs_ptr, row_offs_ptr, out_ptr,
    E, N_OUT, K_DIM, TOPK, stride_am, stride_be, stride_bk, stride_bn,
    GATHER_A: tl.constexpr, SORTED_OUT: tl.constexpr, PREC: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n = (N_OUT + BN - 1) // BN
    tile = pid // num_n
    pid_n = pid % num_n
    # tile_expert[tile] = e with tile_offs[e] <= tile < tile_offs[e+1] (E past the last tile); written inline
    # because a nested jit call costs milliseconds per program under the CPU interpreter
    e = tl.load(tile_expert_ptr + tile)
    if e < E:
        row_start = tl.load(row_offs_ptr + e) + (tile - tl.load(tile_offs_ptr + e)) * BM
        row_end = tl.load(row_offs_ptr + e + 1)
        rows = row_start + tl.arange(0, BM)
        rmask = rows < row_end
        flat = tl.load(order_ptr + rows, mask=rmask, other=0)
        if GATHER_A:
            src = (flat // TOPK).to(tl.int64)
        else:
            src = tl.where(rmask, rows, 0).to(tl.int64)  # tail rows of the last tile may lie past M
        offs_n = pid_n * BN + tl.arange(0, BN)
        nmask = offs_n < N_OUT
        offs_k = tl.arange(0, BK)
        a_ptrs = a_ptr + src[:, None] * stride_am + offs_k[None, :]
        b_ptrs = (b_ptr + e.to(tl.int64) * stride_be + offs_n[None, :].to(tl.int64) * stride_bn
                  + offs_k[:, None].to(tl.int64) * stride_bk)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K_DIM, BK):
            kmask = (k0 + offs_k) < K_DIM
            a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PREC)
            a_ptrs += BK
            b_ptrs += BK * stride_bk
        if SORTED_OUT:
            dst = rows.to(tl.int64)
        else:
            dst = flat.to(tl.int64)
        tl.store(out_ptr + dst[:, None] * N_OUT + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=rmask[:, None] & nmask[None, :])


# ----------------------------------------------------------------------------------------------
# backward of the GLU per sorted row: ∂h = GLU'(h) · (w·∂g'), ∂w = Σ_i ∂g'_i · g_i
# ----------------------------------------------------------------------------------------------
@fast_launch
@triton.jit
def _glu_rows_bwd_kernel(
    dg_ptr, h_ptr, order_ptr, row_offs_ptr, w_ptr, dh_ptr, dw_ptr, M, E, I, beta1, beta2,
    ACT: tl.constexpr, BR: tl.constexpr, BI: tl.constexpr,
):
    # One program per BR of the M sorted rows, looping over I in BI columns. dg [M, I] holds ∂out[tok] @ W2 of each
    # sorted row (unweighted), h [M, 2I] the forward's pre-activations, w [M] the routing weights by slot. Rows past
    # row_offs[E] (slots of no expert, whose dg and h nothing wrote) get ∂w = 0 and no ∂h (nothing reads it). ∂w is
    # one plain store per slot: deterministic (the fused epilogue it replaces added row sums atomically).
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    in_m = rows < M
    routed = rows < tl.load(row_offs_ptr + E)
    flat = tl.load(order_ptr + rows, mask=in_m, other=0)
    wv = tl.load(w_ptr + flat, mask=routed, other=0.0).to(tl.float32)
    rows64 = rows.to(tl.int64)
    dw = tl.zeros((BR,), dtype=tl.float32)
    for i0 in range(0, I, BI):
        cols = i0 + tl.arange(0, BI)
        m = routed[:, None] & (cols < I)[None, :]
        dg = tl.load(dg_ptr + rows64[:, None] * I + cols[None, :], mask=m, other=0.0).to(tl.float32)
        h_ptrs = h_ptr + rows64[:, None] * (2 * I) + cols[None, :]
        ha = tl.load(h_ptrs, mask=m, other=0.0).to(tl.float32)
        hb = tl.load(h_ptrs + I, mask=m, other=0.0).to(tl.float32)
        g, da, db = glu_backward(ha, hb, dg * wv[:, None], ACT, beta1, beta2)
        dw += tl.sum(dg * g, axis=1)
        dh_ptrs = dh_ptr + rows64[:, None] * (2 * I) + cols[None, :]
        tl.store(dh_ptrs, da.to(dh_ptr.dtype.element_ty), mask=m)
        tl.store(dh_ptrs + I, db.to(dh_ptr.dtype.element_ty), mask=m)
    tl.store(dw_ptr + flat, dw, mask=in_m)


# ----------------------------------------------------------------------------------------------
# weight gradients: out[e, p, q] = Σ_{r ∈ rows of e} A[srcA(r), p] · B[srcB(r), q]
# ----------------------------------------------------------------------------------------------
# The K loop runs over the expert's rows, gathered through ``order``. Read in the step that uses them, the slot
# indices put an indirect load in front of the A / B loads, and Triton (3.6 / 3.7, sm_90a) then pipelined those loads
# only two deep whatever num_stages said (64 KB of shared memory at 3 and at 4 stages); read one step ahead, the
# indices are a loop-carried value and the loads take the full depth (96 / 128 KB). On the H200 at the e2e shape
# (benchmarks/results/moe_rows_tune_h200.md, third sweep): ∂W1 1.33 → 1.23 ms at 128 x 128 x 64, and the larger
# tiles, slower than 128 x 128 before, now lead: 256 x 128 1.06 ms (521 TFLOP/s, against 367 at best before);
# ∂W2 0.68 ms at 128 x 128 x 64 either way.
@autotune(
    configs=_cfgs([({"BP": 128, "BQ": 128, "BK": 64}, 8, 3), ({"BP": 256, "BQ": 128, "BK": 64}, 8, 3),
                   ({"BP": 128, "BQ": 256, "BK": 64}, 8, 3)]),
    key=["P", "Q", "TOPK"],
)
@triton.jit
def _wgrad_kernel(
    a_ptr, b_ptr, order_ptr, row_offs_ptr, experts_ptr, out_ptr,
    E, P, Q, stride_am, stride_bm,
    TOPK: tl.constexpr, GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, PREC: tl.constexpr,
    BP: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
):
    pid = tl.program_id(0)
    num_p = (P + BP - 1) // BP
    num_q = (Q + BQ - 1) // BQ
    e = tl.load(experts_ptr + pid // (num_p * num_q))
    rem = pid % (num_p * num_q)
    pid_p = rem // num_q
    pid_q = rem % num_q
    row_start = tl.load(row_offs_ptr + e)
    row_end = tl.load(row_offs_ptr + e + 1)
    offs_p = pid_p * BP + tl.arange(0, BP)
    offs_q = pid_q * BQ + tl.arange(0, BQ)
    pmask = offs_p < P
    qmask = offs_q < Q
    acc = tl.zeros((BP, BQ), dtype=tl.float32)
    rows = row_start + tl.arange(0, BK)
    flat = tl.load(order_ptr + rows, mask=rows < row_end, other=0)
    for _ in range(row_start, row_end, BK):
        rmask = rows < row_end
        if GATHER_A:
            sa = (flat // TOPK).to(tl.int64)
        else:
            sa = rows.to(tl.int64)
        if GATHER_B:
            sb = (flat // TOPK).to(tl.int64)
        else:
            sb = rows.to(tl.int64)
        a = tl.load(a_ptr + sa[None, :] * stride_am + offs_p[:, None], mask=rmask[None, :] & pmask[:, None], other=0.0)
        b = tl.load(b_ptr + sb[:, None] * stride_bm + offs_q[None, :], mask=rmask[:, None] & qmask[None, :], other=0.0)
        # the next step's slots, read one step ahead (see above)
        rows += BK
        flat = tl.load(order_ptr + rows, mask=rows < row_end, other=0)
        acc = tl.dot(a, b, acc, input_precision=PREC)
    out_ptrs = out_ptr + e.to(tl.int64) * P * Q + offs_p[:, None].to(tl.int64) * Q + offs_q[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=pmask[:, None] & qmask[None, :])


# ----------------------------------------------------------------------------------------------
# combine: out[t] = Σ_j [index[t, j] < E] · Y[t·k + j]
# ----------------------------------------------------------------------------------------------
@fast_launch
@triton.jit
def _combine_kernel(y_ptr, idx_ptr, out_ptr, N, L, E, TOPK: tl.constexpr, BT: tl.constexpr, BL: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_l = tl.program_id(1)
    offs_t = pid_t * BT + tl.arange(0, BT)
    offs_l = pid_l * BL + tl.arange(0, BL)
    tmask = offs_t < N
    lmask = offs_l < L
    acc = tl.zeros((BT, BL), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        flat = offs_t.to(tl.int64) * TOPK + j
        ex = tl.load(idx_ptr + flat, mask=tmask, other=E)
        valid = tmask & (ex < E)
        y = tl.load(y_ptr + flat[:, None] * L + offs_l[None, :], mask=valid[:, None] & lmask[None, :], other=0.0)
        acc += y.to(tl.float32)
    tl.store(out_ptr + offs_t.to(tl.int64)[:, None] * L + offs_l[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=tmask[:, None] & lmask[None, :])
