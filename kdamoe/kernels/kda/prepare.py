"""Stage 0 of chunked KDA: chunk table, lower-bounded gate, in-chunk cumulative gate, L2 norm.

Every later stage works on a packed token axis (B = 1, ``cu_seqlens`` of N sequences). A batch of
B equal-length rows is packed as N = B sequences of length T, so there is one code path.

The gate (Kimi Linear report §3): ``g = lb · sigmoid(exp(A_log) · (f + dt_bias))`` in float32, so
``g ∈ [lb, 0]``. ``G`` is the cumulative sum of ``g`` inside each 64-token chunk (restarting at
every chunk and every sequence start), stored in float32.
"""

import torch
import triton
import triton.language as tl

from ..launch import autotune
from ..utils import cached_constant, cdiv

BT = 64  # chunk length (tokens); 4 sub-chunks of 16
BS = 16  # sub-chunk length

# Only the warp count varies, which the CPU interpreter does not have (kdamoe.kernels.utils.autotune).
_PREP_CONFIGS = [triton.Config({}, num_warps=4), triton.Config({}, num_warps=8)]


def _uniform_chunk_table(N: int, per: int, device):
    """:func:`chunk_table` of N sequences of ``per`` chunks each."""
    n = torch.arange(N, device=device, dtype=torch.int32).repeat_interleave(per)
    c = torch.arange(per, device=device, dtype=torch.int32).repeat(N)
    offsets = torch.arange(N + 1, device=device, dtype=torch.int32) * per
    return torch.stack([n, c], 1).contiguous(), offsets, N * per


def chunk_table(cu_seqlens: torch.Tensor, total_tokens: int, uniform_len: int = None):
    """Chunk index table for a packed batch.

    Args:
        cu_seqlens: int ``[N+1]`` on the compute device.
        total_tokens: length of the packed token axis.
        uniform_len: if every sequence has this length, the table is built without a host sync.

    Returns:
        ``(chunk_idx, chunk_offsets, num_chunks)``: ``chunk_idx`` int32 ``[NC, 2]`` of
        (sequence, chunk-in-sequence); ``chunk_offsets`` int32 ``[N+1]`` index of each sequence's
        first chunk; ``num_chunks`` = NC (python int).
    """
    device = cu_seqlens.device
    N = cu_seqlens.numel() - 1
    if uniform_len is not None:
        # depends on (N, per) only: built once and reused (seven launches per call before), read-only
        per = cdiv(uniform_len, BT)
        return cached_constant(("kda_chunk_table", N, per, device), lambda: _uniform_chunk_table(N, per, device))
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    per = (lens + BT - 1) // BT
    per_host = per.tolist()  # one host sync, as any varlen kernel launch needs the grid size
    NC = int(sum(per_host))
    offsets = torch.zeros(N + 1, dtype=torch.int32, device=device)
    offsets[1:] = torch.cumsum(per, 0).to(torch.int32)
    n = torch.repeat_interleave(torch.arange(N, device=device, dtype=torch.int32), per, output_size=NC)
    c = torch.arange(NC, device=device, dtype=torch.int32) - offsets[:-1].repeat_interleave(per, output_size=NC)
    return torch.stack([n, c], 1).contiguous(), offsets, NC


@triton.jit
def chunk_bounds(chunk_idx, cu_seqlens, i_c, BT: tl.constexpr):
    """(first token of the chunk, end of its sequence) on the packed axis."""
    i_n = tl.load(chunk_idx + i_c * 2)
    i_t = tl.load(chunk_idx + i_c * 2 + 1)
    bos = tl.load(cu_seqlens + i_n)
    eos = tl.load(cu_seqlens + i_n + 1)
    return bos + i_t * BT, eos


@triton.jit
def prepare_chunk(q, k, g, qn, kn, rq, rk, G, A_log, dt_bias, t0, eos, i_h, lower_bound, H: tl.constexpr,
                  K: tl.constexpr, BT: tl.constexpr, USE_L2: tl.constexpr, GATE_IN: tl.constexpr,
                  HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr):
    """One chunk and head: G = in-chunk cumsum of the (optionally in-kernel) gate; qn, kn, rq, rk.

    Key channels are independent for the gate, so it runs over 32-channel slices (few live registers);
    the L2 norm takes two passes over the slices (sums of squares, then the scaled store)."""
    BK: tl.constexpr = 32 if K > 32 else K
    rows = t0 + tl.arange(0, BT)
    mrow = rows < eos
    m2 = mrow[:, None]
    tok = (rows * H + i_h).to(tl.int64)
    for kk in range(0, K, BK):
        cols = kk + tl.arange(0, BK)
        off = tok[:, None] * K + cols[None, :]
        x = tl.load(g + off, mask=m2, other=0.).to(tl.float32)
        if GATE_IN:
            if HAS_BIAS:
                x += tl.load(dt_bias + i_h * K + cols).to(tl.float32)[None, :]
            if HAS_A:
                x *= tl.exp(tl.load(A_log + i_h).to(tl.float32))
            x = tl.where(m2, lower_bound * tl.sigmoid(x), 0.)
        tl.store(G + off, tl.cumsum(x, 0), mask=m2)
    if USE_L2:
        sq = tl.zeros([BT], dtype=tl.float32)
        sk = tl.zeros([BT], dtype=tl.float32)
        for kk in range(0, K, BK):
            off = tok[:, None] * K + kk + tl.arange(0, BK)[None, :]
            b_q = tl.load(q + off, mask=m2, other=0.).to(tl.float32)
            b_k = tl.load(k + off, mask=m2, other=0.).to(tl.float32)
            sq += tl.sum(b_q * b_q, 1)
            sk += tl.sum(b_k * b_k, 1)
        r_q = tl.rsqrt(sq + 1e-6)
        r_k = tl.rsqrt(sk + 1e-6)
        tl.store(rq + rows * H + i_h, r_q, mask=mrow)
        tl.store(rk + rows * H + i_h, r_k, mask=mrow)
        for kk in range(0, K, BK):
            off = tok[:, None] * K + kk + tl.arange(0, BK)[None, :]
            b_q = tl.load(q + off, mask=m2, other=0.).to(tl.float32)
            b_k = tl.load(k + off, mask=m2, other=0.).to(tl.float32)
            tl.store(qn + off, (b_q * r_q[:, None]).to(qn.dtype.element_ty), mask=m2)
            tl.store(kn + off, (b_k * r_k[:, None]).to(kn.dtype.element_ty), mask=m2)


def prepare_buffers(q, k, use_l2):
    """``(qn, kn, rq, rk, G)`` outputs of :func:`prepare_chunk` for packed ``[1, T, H, K]`` q, k: qn, kn like q, k
    (q, k themselves when ``use_l2`` is False), rq, rk ``[T, H]`` float32 (or None), G ``[1, T, H, K]`` float32."""
    _, T, H, K = q.shape
    G = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    if not use_l2:
        return q, k, None, None, G
    rq = torch.empty(T, H, dtype=torch.float32, device=q.device)
    return torch.empty_like(q), torch.empty_like(k), rq, torch.empty_like(rq), G


@autotune(configs=_PREP_CONFIGS, key=['H', 'K', 'USE_L2', 'GATE_IN'])
@triton.jit
def _prepare_fwd_kernel(q, k, g, qn, kn, rq, rk, G, A_log, dt_bias, chunk_idx, cu_seqlens, lower_bound,
                        H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, USE_L2: tl.constexpr,
                        GATE_IN: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = chunk_bounds(chunk_idx, cu_seqlens, i_c, BT)
    prepare_chunk(q, k, g, qn, kn, rq, rk, G, A_log, dt_bias, t0, eos, i_h, lower_bound, H, K, BT, USE_L2, GATE_IN,
                  HAS_A, HAS_BIAS)


def prepare_fwd(q, k, g, A_log, dt_bias, lower_bound, chunk_idx, cu_seqlens, NC, use_l2, gate_in):
    """Gate, in-chunk cumsum and optional L2 norm as a kernel of its own (the forward runs the same code at the
    start of the intra kernel; this one serves benchmarks). Inputs are packed ``[1, T, H, K]``.

    Returns ``(qn, kn, rq, rk, G)`` as :func:`prepare_buffers` describes.
    """
    H, K = q.shape[2], q.shape[3]
    qn, kn, rq, rk, G = prepare_buffers(q, k, use_l2)
    if NC > 0:
        _prepare_fwd_kernel[(NC, H)](
            q, k, g, qn, kn, rq, rk, G, A_log, dt_bias, chunk_idx, cu_seqlens, float(lower_bound),
            H=H, K=K, BT=BT, USE_L2=use_l2, GATE_IN=gate_in, HAS_A=A_log is not None,
            HAS_BIAS=dt_bias is not None)
    return qn, kn, rq, rk, G
