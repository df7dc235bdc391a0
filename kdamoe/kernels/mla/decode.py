"""Flash-decoding of MLA attention in the latent space: keys = values = the cached latent, shared by all heads.

Semantics are those of ``kdamoe.model.mla_torch.latent_attention_torch`` (its reference): ``q [B, T, H, R + Dr]``
absorbed queries, ``latent [B, S_cap, R + Dr]`` the cache buffer (keys: whole rows; values: their first ``R =
value_dim`` columns; ``Dr`` is the shared key part, ``qk_rope_head_dim``, 0 by default), ``seq_len`` a device tensor
(valid rows, the T new tokens included), causal over ``p_t = seq_len − T + t``, an optional padding ``key_mask``.

Design (Dao et al., "Flash-Decoding for long-context inference", 2023; the online softmax of FlashAttention-2,
Dao 2023, §3.1):

* The ``T·H`` query rows of a batch row form one matrix (row ``t·H + h``); every latent block loaded is used by
  all of them, so the cache is read once per row block (multi-query attention). Rows are blocked by
  ``BLOCK_M ≥ 16`` (``tl.dot``'s minimum; ``T·H = 8`` is padded to 16 with masked rows).
* Stage 1, ``_split_kernel``, grid ``(row blocks, P splits, B)``: split ``j`` takes the key blocks
  ``j, j + P, j + 2P, …`` of ``BLOCK_N`` keys (round robin), so any ``seq_len`` spreads over all splits: a
  short sequence in a long buffer still uses ``min(P, blocks)`` programs instead of one. For each block:
  ``S = Q Kᵀ`` (fp32 accumulation; with ``Dr > 0`` the score is split as ``Q_c K_cᵀ + Q_r K_rᵀ`` over the first ``R``
  and the last ``Dr`` columns, the latter padded to a power of two ≥ 16 with masked loads, so ``R`` stays a power of
  two whatever ``Dr`` is, and only ``K_c`` is the value tile), mask (causal, ``key_mask``, ``s < seq_len``) to
  ``−inf`` before the exponential, online softmax, ``acc += P K``. Keys at or after ``seq_len`` and masked keys are
  loaded as 0 (never NaN · 0). It writes the unnormalised ``acc``, running max and sum to a float32 workspace
  ``[B, P, T·H, R]`` / ``[B, P, T·H]``; a split that starts at or after the block's last visible key exits.
* Stage 2, ``_combine_kernel``, one program per (row, R chunk, b): log-sum-exp merge of the splits the row can
  see, ``o = Σ_j e^{m_j − M} acc_j / Σ_j e^{m_j − M} l_j`` (0 when no key is visible).

The grid and the workspace depend only on shapes (B, T, H, R, S_cap): ``seq_len`` and ``key_mask`` are read
on the device, so a call is capturable in a CUDA graph and replays with a new value in the same ``seq_len``
tensor. Out-of-range ``seq_len`` values are clamped in the kernel to ``min(S_cap, S_mask)`` (a value check
would sync).

Bytes and FLOPs (B = 1, H = 8, T = 1, R = 256, bf16, seq_len = 2^20): the cache read is
2^20 · 256 · 2 B = 512 MiB; ``2 · 2 · H · R = 8 KFLOP`` of useful work per key (16 KFLOP with the rows padded to
16), i.e. ≈ 32 FLOP/B against the H200's ≈ 165 FLOP/B balance point (≈ 790 TFLOP/s / 4.8 TB/s): memory bound,
≈ 0.11 ms at peak bandwidth. The workspace adds ``P · T·H · R · 4`` bytes written and read once (2 MiB at
P = 264), small against the cache; B = 8 reads 8× the bytes. At seq_len = 4096 (2 MiB) the two launches dominate.

Measured on one H200 (Triton 3.6, CUDA-graph replay, ``triton.testing.do_bench`` with its L2 flush), with the
block sizes below: B = 1, seq_len = S_cap = 2^20: 142 µs (3.8 TB/s of cache read); seq_len = 4096: 11 µs, the
same in a 2^20-row buffer; B = 8 at 2^20: 0.95 ms (4.5 TB/s); T = 64 at 65536 keys: 102 µs (≈ 340 TFLOP/s,
compute bound). Sweeping BLOCK_N ∈ {32, 64, 128}, 2–8 warps, 2–4 stages and 1, 2 or 4 programs per SM gave
no faster setting for these shapes (4 per SM: 182 µs at 2^20; 1 per SM: 1.48 ms at B = 8).

With a shared key part, on one H100 (Triton 3.6, torch 2.11, ``do_bench`` of eager launches, B = 1, T = 1, H = 8,
R = 256, bf16, 2^20 keys): Dr = 64 took 243 µs against 198 µs for Dr = 0 on the same machine, the 1.25× of the bytes
read (2.8 and 2.7 TB/s).
"""


import torch
import triton
import triton.language as tl

from ..launch import fast_launch
from ..utils import cdiv, is_interpreter, next_power_of_2, sm_count

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_MASK_DTYPES = (torch.bool, torch.int8, torch.int32, torch.int64)  # key_mask dtypes the kernel loads


# The op's own argument checks (the same rules as the PyTorch reference in kdamoe/model/, which keeps its own
# copy: the model folder loads without kdamoe.kernels, and the kernels import nothing but torch and triton).
def check_latent_attention_args(q, latent, seq_len, key_mask, floats=_FLOATS, value_dim=None) -> None:
    """Shape / dtype / device checks shared by the latent-attention ops (never a value check: no host sync).

    Raises:
        ValueError: naming the bad argument (see :func:`latent_attention_torch`).
    """
    for name, t in (("q", q), ("latent", latent), ("seq_len", seq_len)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, R], got shape {tuple(q.shape)}")
    B, T, H, R = q.shape
    if T < 1 or H < 1 or R < 1:
        raise ValueError(f"q must have T, H, R >= 1, got shape {tuple(q.shape)}")
    if latent.dim() != 3 or latent.shape[0] != B or latent.shape[2] != R:
        raise ValueError(f"latent must be [B, S_cap, R] = ({B}, S_cap, {R}) like q, got shape {tuple(latent.shape)}")
    if value_dim is not None and (not isinstance(value_dim, int) or isinstance(value_dim, bool)
                                  or not 1 <= value_dim <= R):
        raise ValueError(f"value_dim must be None or an integer in [1, {R}] (q's last dim), got {value_dim!r}")
    if q.dtype not in floats:
        raise ValueError(f"q dtype must be one of {floats}, got {q.dtype}")
    if latent.dtype != q.dtype:
        raise ValueError(f"latent dtype {latent.dtype} differs from q dtype {q.dtype}")
    if latent.stride(2) != 1:
        raise ValueError(f"latent must have a contiguous last dim, got strides {latent.stride()}")
    if seq_len.dtype not in (torch.int32, torch.int64) or seq_len.numel() != 1 or seq_len.dim() > 1:
        raise ValueError(f"seq_len must be an int32/int64 tensor of shape [] or [1], got {seq_len.dtype} "
                         f"of shape {tuple(seq_len.shape)}")
    for name, t in (("latent", latent), ("seq_len", seq_len)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, expected {q.device} like q")
    if key_mask is not None:
        if not isinstance(key_mask, torch.Tensor) or key_mask.dim() != 2 or key_mask.shape[0] != B:
            shape = tuple(key_mask.shape) if isinstance(key_mask, torch.Tensor) else type(key_mask).__name__
            raise ValueError(f"key_mask must be [B, S_mask] with B = {B}, got {shape}")
        if key_mask.dtype not in _MASK_DTYPES:
            raise ValueError(f"key_mask dtype must be bool, int8, int32 or int64, got {key_mask.dtype}")
        if key_mask.device != q.device:
            raise ValueError(f"key_mask is on {key_mask.device}, expected {q.device} like q")


COMBINE_BLOCK_R = 32  # R chunk of one combine program: 8 rows × (256 / 32) = 64 programs at B = 1, T = 1
COMBINE_CHUNK_P = 64  # splits merged per combine step ([64, 32] fp32 tile)
PROGRAMS_PER_SM = 2  # split programs per SM at B = 1: enough loads in flight to saturate HBM
NUM_STAGES = 3  # software-pipelined key tiles in flight per split program
MAX_SHARED_DIM = 256  # widest shared key part Dr (its [BLOCK_N, Dr] tile rides next to the [BLOCK_N, R] one)


@triton.jit
def online_softmax_step(s, v_tile, acc, m_i, l_i, IEEE: tl.constexpr):
    """One key block of flash-decoding's online softmax (Dao et al. 2023; Milakov & Gimelshein 2018): scores
    ``s [M, N]`` (log2 units, masked keys at −inf) and values ``v_tile [N, R]`` fold into the running accumulator
    ``acc [M, R]``, max ``m_i [M]`` and sum ``l_i [M]`` (float32); returns the new ``(acc, m_i, l_i)``. A row with no
    visible key yet keeps max −inf and contributes 0 (exp2(−inf) = 0)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0., m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v_tile, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile)
    return acc, m_new, l_i


@fast_launch
@triton.jit
def _split_kernel(q, latent, seq_len, key_mask, acc_ws, m_ws, l_ws,
                  T, H, M, P, S_lim, qk_scale,
                  stride_qb, stride_lb, stride_ls, stride_kb, stride_ks,
                  R: tl.constexpr, DR: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, IEEE: tl.constexpr):
    i_m, i_p, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = tl.minimum(tl.load(seq_len), S_lim).to(tl.int32)
    rows = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    pos = tl.where(row_ok, n - T + rows // H, -1)  # last key each row sees; padded rows see none
    last_row = tl.minimum(i_m * BLOCK_M + BLOCK_M, M) - 1
    hi = tl.minimum(n - T + last_row // H + 1, n)  # keys [0, hi) are all this block may see
    if i_p * BLOCK_N >= hi:
        return  # no block of this split is visible to these rows; the combine skips it too
    cols_r = tl.arange(0, R)
    q_row = i_b.to(tl.int64) * stride_qb + rows[:, None].to(tl.int64) * (R + DR)  # q is contiguous, rows R + DR wide
    q_tile = tl.load(q + q_row + cols_r[None, :], mask=row_ok[:, None], other=0.)
    if DR > 0:
        cols_d = tl.arange(0, BLOCK_DR)
        d_ok = cols_d < DR
        qr_tile = tl.load(q + q_row + R + cols_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, R], dtype=tl.float32)
    lat_base = latent + i_b.to(tl.int64) * stride_lb
    for blk in range(i_p, tl.cdiv(hi, BLOCK_N), P):
        keys = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        key_ok = keys < hi
        if HAS_MASK:
            km = tl.load(key_mask + i_b.to(tl.int64) * stride_kb + keys.to(tl.int64) * stride_ks, mask=key_ok, other=0)
            key_ok = key_ok & (km != 0)
        k_tile = tl.load(lat_base + keys[:, None].to(tl.int64) * stride_ls + cols_r[None, :],
                         mask=key_ok[:, None], other=0.)  # garbage and padded rows load as 0
        if IEEE:
            s = tl.dot(q_tile, tl.trans(k_tile), input_precision="ieee")
        else:
            s = tl.dot(q_tile, tl.trans(k_tile))
        if DR > 0:  # the shared key part: scores only, never a value
            kr_tile = tl.load(lat_base + keys[:, None].to(tl.int64) * stride_ls + R + cols_d[None, :],
                              mask=key_ok[:, None] & d_ok[None, :], other=0.)
            if IEEE:
                s += tl.dot(qr_tile, tl.trans(kr_tile), input_precision="ieee")
            else:
                s += tl.dot(qr_tile, tl.trans(kr_tile))
        visible = key_ok[None, :] & (keys[None, :] <= pos[:, None])
        s = tl.where(visible, s * qk_scale, float("-inf"))  # masked before the exponential
        acc, m_i, l_i = online_softmax_step(s, k_tile, acc, m_i, l_i, IEEE)

    ws_rows = (i_b * P + i_p).to(tl.int64) * M + rows
    tl.store(acc_ws + ws_rows[:, None] * R + cols_r[None, :], acc, mask=row_ok[:, None])
    tl.store(m_ws + ws_rows, m_i, mask=row_ok)
    tl.store(l_ws + ws_rows, l_i, mask=row_ok)


@fast_launch
@triton.jit
def _combine_kernel(acc_ws, m_ws, l_ws, o, seq_len, T, H, M, P, S_lim, stride_ob,
                    R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, CHUNK_P: tl.constexpr,
                    BLOCK_R: tl.constexpr):
    row, i_r, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = tl.minimum(tl.load(seq_len), S_lim).to(tl.int32)
    pos = n - T + row // H
    # Split j wrote this row iff its first block j·BLOCK_N holds a key <= pos (the split kernel's exit test).
    n_split = tl.minimum(P, tl.maximum(tl.cdiv(pos + 1, BLOCK_N), 0))
    base = (i_b * P).to(tl.int64) * M + row
    splits = tl.arange(0, BLOCK_P)
    m_all = tl.load(m_ws + base + splits.to(tl.int64) * M, mask=splits < n_split, other=float("-inf"))
    m_max = tl.max(m_all, 0)
    m_max = tl.where(m_max == float("-inf"), 0., m_max)
    cols = i_r * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    denom = tl.zeros([CHUNK_P], dtype=tl.float32)
    for start in range(0, n_split, CHUNK_P):
        j = start + tl.arange(0, CHUNK_P)
        ok = j < n_split
        off = base + j.to(tl.int64) * M
        w = tl.exp2(tl.load(m_ws + off, mask=ok, other=float("-inf")) - m_max)
        denom += w * tl.load(l_ws + off, mask=ok, other=0.)
        part = tl.load(acc_ws + off[:, None] * R + cols[None, :], mask=ok[:, None], other=0.)
        acc += tl.sum(w[:, None] * part, 0)
    total = tl.sum(denom, 0)
    out = tl.where(total > 0, acc / tl.where(total > 0, total, 1.), 0.)
    tl.store(o + i_b.to(tl.int64) * stride_ob + row.to(tl.int64) * R + cols, out.to(o.dtype.element_ty))


def block_sizes(M: int, R: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps)`` of the split kernel for ``M = T·H`` query rows of width ``R``.

    Fixed, not autotuned: the autotuner would time the first call, whose ``seq_len`` (a device value it cannot
    see) is often tiny. Chosen by the H200 sweep of the module docstring. ``BLOCK_M`` grows with ``M`` (more rows per
    loaded key block) while the fp32 accumulator ``[BLOCK_M, R]`` stays ≤ 64 registers per thread; the key tile
    ``[BLOCK_N, R]`` is 32 KiB.
    """
    block_m = 16 if M <= 16 else 32 if (M <= 32 or R >= 512) else 64
    block_n = max(16, min(128, 16384 // R))
    num_warps = 4 if block_m * R <= 16 * 256 else 8
    return block_m, block_n, num_warps


def num_splits(B: int, row_blocks: int, key_blocks: int, sms: int) -> int:
    """Splits ``P`` of the key axis: about ``PROGRAMS_PER_SM`` programs per SM over ``B · row_blocks · P``,
    at most one split per key block of the buffer. Depends on shapes only (CUDA-graph safe)."""
    return max(1, min(key_blocks, cdiv(PROGRAMS_PER_SM * sms, B * row_blocks)))


def _validate(q, latent, seq_len, key_mask, value_dim):
    """The shape / dtype / device checks of the torch op, plus the kernel's limits (R, Dr, dtype, device)."""
    check_latent_attention_args(q, latent, seq_len, key_mask, floats=_FLOATS, value_dim=value_dim)
    R = q.shape[3] if value_dim is None else value_dim
    if R < 16 or R > 512 or R & (R - 1):
        raise ValueError(f"the value width R (kv_lora_rank; value_dim, else q's last dim) must be a power of two in "
                         f"[16, 512] for the kernel, got {R}")
    if q.shape[3] - R > MAX_SHARED_DIM:
        raise ValueError(f"the shared key part (q's last dim {q.shape[3]} − value_dim {R}) must be at most "
                         f"{MAX_SHARED_DIM} columns for the kernel, got {q.shape[3] - R}")
    if q.device.type != "cuda" and not (q.device.type == "cpu" and is_interpreter()):
        raise ValueError(f"q is on {q.device}: the Triton kernels need a CUDA tensor (or CPU with TRITON_INTERPRET=1)")


def latent_attention(q, latent, seq_len, scale, key_mask=None, value_dim=None):
    r"""Causal multi-query attention over the latent cache (keys = ``latent``'s rows, values = their first
    ``V = value_dim`` columns), flash-decoding in Triton.

    Query ``t`` sits at ``p_t = seq_len − T + t`` and sees key ``s`` iff ``s ≤ p_t`` and ``key_mask[b, s] ≠ 0``::

        o[b, t, h] = Σ_{s visible} softmax_s(scale · q[b, t, h] · latent[b, s]) · latent[b, s, :V]

    0 for a query with no visible key. float32 accumulation; rows of ``latent`` at or after ``seq_len`` are
    never read into the result. No host synchronisation (CUDA-graph capturable; the launch depends on shapes
    only). Forward only.

    Args:
        q: ``[B, T, H, V + Dr]`` float16 / bfloat16 / float32 absorbed queries (``[W_ukᵀ q_nope | q_shared]``).
        latent: ``[B, S_cap, V + Dr]`` q's dtype (rows ``[c | k_shared]``), last dim contiguous (the cache buffer;
            the T new tokens are already written at rows ``seq_len − T … seq_len − 1``).
        seq_len: int32 / int64 tensor of shape ``[]`` or ``[1]`` on q's device; expected in
            ``[T, min(S_cap, S_mask)]`` and clamped to ``min(S_cap, S_mask)`` in the kernel.
        scale: softmax scale (Python float).
        key_mask: optional ``[B, S_mask]`` bool / int8 / int32 / int64 padding mask (nonzero = attend).
        value_dim: ``V``, a power of two in [16, 512]; None → q's whole last dim (then ``Dr = 0``). The shared key
            part ``Dr`` may be any width up to ``MAX_SHARED_DIM``.

    Returns:
        ``o_lat [B, T, H, V]`` in q's dtype.

    Raises:
        ValueError: a wrong rank, shape, dtype or device, or V / Dr outside the kernel's sizes, naming the argument;
            q or latent requiring grad while grad mode is on (there is no backward: the result would silently carry
            none).
    """
    _validate(q, latent, seq_len, key_mask, value_dim)
    if torch.is_grad_enabled() and (q.requires_grad or latent.requires_grad):
        raise ValueError("latent_attention has no backward: q or latent requires grad; run it under torch.no_grad() "
                         "or use kdamoe.model.mla_torch.latent_attention_torch, which is differentiable")
    B, T, H, width = q.shape
    R = width if value_dim is None else value_dim
    DR = width - R
    M, S_cap = T * H, latent.shape[1]
    S_lim = S_cap if key_mask is None else min(S_cap, key_mask.shape[1])
    o = q.new_empty(B, T, H, R)
    if S_lim == 0:
        return o.zero_()
    q = q.contiguous()
    if key_mask is not None and key_mask.dtype == torch.bool:
        key_mask = key_mask.view(torch.uint8)  # same bytes, a plain integer pointer for Triton
    block_m, block_n, num_warps = block_sizes(M, R)
    row_blocks = cdiv(M, block_m)
    P = num_splits(B, row_blocks, cdiv(S_lim, block_n), sm_count(q.device))
    acc_ws = torch.empty(B, P, M, R, dtype=torch.float32, device=q.device)
    m_ws = torch.empty(B, P, M, dtype=torch.float32, device=q.device)
    l_ws = torch.empty(B, P, M, dtype=torch.float32, device=q.device)
    mask_arg = key_mask if key_mask is not None else seq_len  # never read without HAS_MASK
    mask_strides = key_mask.stride() if key_mask is not None else (0, 0)
    _split_kernel[(row_blocks, P, B)](
        q, latent, seq_len, mask_arg, acc_ws, m_ws, l_ws, T, H, M, P, S_lim, scale * 1.4426950408889634,
        q.stride(0), latent.stride(0), latent.stride(1), mask_strides[0], mask_strides[1],
        R=R, DR=DR, BLOCK_DR=max(16, next_power_of_2(DR)), BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_MASK=key_mask is not None, IEEE=q.dtype == torch.float32,
        num_warps=num_warps, num_stages=NUM_STAGES)
    block_r = min(R, COMBINE_BLOCK_R)
    _combine_kernel[(M, R // block_r, B)](
        acc_ws, m_ws, l_ws, o, seq_len, T, H, M, P, S_lim, o.stride(0),
        R=R, BLOCK_N=block_n, BLOCK_P=next_power_of_2(P), CHUNK_P=COMBINE_CHUNK_P, BLOCK_R=block_r,
        num_warps=4)
    return o
