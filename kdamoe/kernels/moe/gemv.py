"""Decode fast path of the routed experts: two GEMV kernels, no permutation plan.

One decode step routes only ``M = N·k`` rows (N tokens, k slots each; e.g. N ≤ 8, k = 8 → M ≤ 64). The
grouped path of ``experts.py`` then spends its time on launches: the permutation plan (sort, searchsorted,
cumsum, casts: 15–20 small kernels) and ``ceil(M/64) + E`` row tiles of 64 rows holding about one real row per
expert. Here each routed row reads its expert's weights directly, in two kernels:

  gate/up + GLU   h[r, i] = GLU(W1[e, i, :] · x[t], W1[e, I + i, :] · x[t])        r = t·k + j, e = index[t, j]
  down + combine  out[t, n] = Σ_{j: e < E} w[t, j] · (W2[e, n, :] · h[t·k + j])

with ``W1 = gate_up_proj [E, 2I, ℓ]``, ``W2 = down_proj [E, ℓ, I]``, float32 accumulation, GLU of
``activation.py`` (SiTU-GLU, Kimi K3 report §2.3, or SwiGLU). Rounding points differ from the grouped path's:
here ``h`` is stored in the input dtype before the down projection and the routing weight (any float dtype, read as
float32) scales each slot's contribution in float32; the grouped path stores ``w · GLU`` in the input dtype (one
rounding after the weight) and rounds every slot's output to the input dtype before its combine kernel sums them,
while here the sum over slots stays in float32 and the output is rounded once (no extra buffer, no third kernel).

Slots with ``index == E`` (expert parallelism: another rank's expert) are skipped by both kernels; their rows
of ``h`` are never written nor read. No host synchronisation and no data-dependent shape: the path can be
captured in a CUDA graph. Expert layout: LatentMoE (arXiv:2601.18089).
"""

import torch
import triton
import triton.language as tl

from ..launch import autotune
from ..utils import cdiv
from .activation import glu_forward


def _cfgs(gpu):
    """``triton.Config`` list from ``(kwargs, num_warps)``; the first one is also the CPU interpreter's
    (``kdamoe.kernels.utils.autotune``)."""
    return [triton.Config(c, num_warps=w) for c, w in gpu]


# Block sizes: at N = 1 (M = k rows) few programs would leave most of the H200's 132 SMs idle, so the column
# blocks are narrow (8–64 columns) and the reduction blocks wide (64–256 contiguous elements per weight row).
# The float32 accumulator tiles hold 16–64 registers per thread (two tiles in the gate/up kernel). The first
# config of each list is also the interpreter's (few programs: the interpreter pays per program).
@autotune(
    configs=_cfgs([({"BLOCK_I": 64, "BLOCK_K": 128}, 8), ({"BLOCK_I": 32, "BLOCK_K": 128}, 4),
                   ({"BLOCK_I": 16, "BLOCK_K": 256}, 4), ({"BLOCK_I": 32, "BLOCK_K": 256}, 8)]),
    key=["I", "L"],
)
@triton.jit
def _gate_up_glu_gemv_kernel(
    x_ptr, idx_ptr, w1_ptr, h_ptr, E, I, L, TOPK, beta1, beta2,
    ACT: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program (row r = t·k + j, block of I columns): ``h[r, block] = GLU(gate · x[t], up · x[t])``."""
    r = tl.program_id(0)
    pid_i = tl.program_id(1)
    e = tl.load(idx_ptr + r)
    if e < E:
        t = (r // TOPK).to(tl.int64)
        offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
        imask = offs_i < I
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + t * L + offs_k
        w1_e = w1_ptr + e.to(tl.int64) * 2 * I * L
        wg_ptrs = w1_e + offs_i[:, None].to(tl.int64) * L + offs_k[None, :]
        wu_ptrs = w1_e + (offs_i + I)[:, None].to(tl.int64) * L + offs_k[None, :]
        # elementwise products accumulate in [BLOCK_I, BLOCK_K] float32 tiles, reduced once after the loop
        acc_g = tl.zeros((BLOCK_I, BLOCK_K), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_I, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, L, BLOCK_K):
            kmask = (k0 + offs_k) < L
            xv = tl.load(x_ptrs, mask=kmask, other=0.0).to(tl.float32)
            wmask = imask[:, None] & kmask[None, :]
            wg = tl.load(wg_ptrs, mask=wmask, other=0.0).to(tl.float32)
            wu = tl.load(wu_ptrs, mask=wmask, other=0.0).to(tl.float32)
            acc_g += wg * xv[None, :]
            acc_u += wu * xv[None, :]
            x_ptrs += BLOCK_K
            wg_ptrs += BLOCK_K
            wu_ptrs += BLOCK_K
        g = glu_forward(tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1), ACT, beta1, beta2)
        tl.store(h_ptr + r.to(tl.int64) * I + offs_i, g.to(h_ptr.dtype.element_ty), mask=imask)


@autotune(
    configs=_cfgs([({"BLOCK_N": 32, "BLOCK_I": 128}, 4), ({"BLOCK_N": 16, "BLOCK_I": 128}, 4),
                   ({"BLOCK_N": 8, "BLOCK_I": 256}, 4), ({"BLOCK_N": 64, "BLOCK_I": 64}, 4)]),
    key=["I", "L"],
)
@triton.jit
def _down_combine_gemv_kernel(
    h_ptr, idx_ptr, w_ptr, w2_ptr, out_ptr, E, I, L, TOPK,
    BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr,
):
    """Program (token t, block of ℓ columns): ``out[t, block] = Σ_j w[t,j] · W2[e_tj, block, :] · h[t·k+j]``."""
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < L
    offs_i = tl.arange(0, BLOCK_I)
    # Σ_j w_j Σ_i W2[e_j, n, i] h_j[i] accumulates elementwise in a [BLOCK_N, BLOCK_I] float32 tile, reduced
    # once at the end; the routing weight scales h_j in float32 (the grouped path stores w·GLU rounded instead)
    acc = tl.zeros((BLOCK_N, BLOCK_I), dtype=tl.float32)
    w2_offs = offs_n[:, None].to(tl.int64) * I + offs_i[None, :]
    row0 = t.to(tl.int64) * TOPK
    for j in range(0, TOPK):
        r = row0 + j
        e = tl.load(idx_ptr + r)
        if e < E:
            wv = tl.load(w_ptr + r).to(tl.float32)
            h_ptrs = h_ptr + r * I + offs_i
            w2_ptrs = w2_ptr + e.to(tl.int64) * L * I + w2_offs
            for i0 in range(0, I, BLOCK_I):
                imask = (i0 + offs_i) < I
                hv = tl.load(h_ptrs, mask=imask, other=0.0).to(tl.float32) * wv
                wt = tl.load(w2_ptrs, mask=nmask[:, None] & imask[None, :], other=0.0).to(tl.float32)
                acc += wt * hv[None, :]
                h_ptrs += BLOCK_I
                w2_ptrs += BLOCK_I
    out = tl.sum(acc, axis=1)
    tl.store(out_ptr + t.to(tl.int64) * L + offs_n, out.to(out_ptr.dtype.element_ty), mask=nmask)


def moe_experts_gemv(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, act, beta1, beta2):
    """Forward of ``moe_experts`` for few routed rows, without autograd: two kernel launches, no host sync.

    Called by :func:`kdamoe.kernels.moe.experts.moe_experts` (which validates the arguments and decides when
    this path runs); computes ``out[t] = Σ_{j: idx[t,j] < E} w[t,j] · W2[e] GLU(W1[e] x[t])``, ``e = idx[t,j]``.

    Args:
        hidden_states: [N, ℓ] float16 / bfloat16 / float32, N ≥ 1.
        top_k_index: [N, k] int32 / int64 expert ids in [0, E]; ``E`` marks a skipped slot.
        top_k_weights: [N, k] any float dtype (read as float32).
        gate_up_proj: [E, 2I, ℓ], dtype of ``hidden_states`` (gate rows ``[:I]``, up rows ``[I:]``).
        down_proj: [E, ℓ, I], dtype of ``hidden_states``.
        act: ``activation.ACT_SITU`` or ``activation.ACT_SILU``.
        beta1, beta2: SiTU-GLU β1, β2 (unused for SiLU).

    Returns:
        [N, ℓ] in the dtype of ``hidden_states`` (not connected to any autograd graph).
    """
    x = hidden_states.contiguous()
    idx = top_k_index.contiguous()
    w = top_k_weights.contiguous()
    w1 = gate_up_proj.contiguous()
    w2 = down_proj.contiguous()
    n, hid = x.shape
    k = idx.shape[1]
    e, two_i, _ = w1.shape
    inter = two_i // 2
    h = torch.empty(n * k, inter, device=x.device, dtype=x.dtype)
    grid_a = lambda meta: (n * k, cdiv(inter, meta["BLOCK_I"]))
    _gate_up_glu_gemv_kernel[grid_a](x, idx, w1, h, e, inter, hid, k, beta1, beta2, ACT=act)
    out = torch.empty(n, hid, device=x.device, dtype=x.dtype)
    grid_b = lambda meta: (n, cdiv(hid, meta["BLOCK_N"]))
    _down_combine_gemv_kernel[grid_b](h, idx, w, w2, out, e, inter, hid, k)
    return out
