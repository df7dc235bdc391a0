"""MLA decode in the latent space for N sequences whose cached rows are a group's shared prefix plus rows of their own,
the prefix read once for all the group's members.

The rollout engine forks a GRPO group after its prompt: the prompt's MLA rows become one prefix tensor ``[L_g, D]``
that every member references, and each member appends its own rows to a buffer ``[L_n, D]`` (``D = R + Dr``: the
normed latent ``c`` then the key part shared by every head). One decode query per sequence (``H`` heads, absorbed:
``[W_ukᵀ q_nope | q_shared]``) sees all of its group's prefix rows and all of its own (the new token's row included)::

    o[n, h] = Σ_{s ∈ prefix(g(n)) ∪ own(n)} softmax_s(scale · q[n, h] · row_s) · row_s[:R]

Design: flash-decoding (Dao et al. 2023) over *segments*: segment ``g < G`` is group g's prefix, its query rows all
its members' heads (``members · H`` rows, one matrix: every prefix block loaded is used by the whole group, so the
prefix is read once per group and step, not once per member); segment ``G + n`` is sequence n's own rows with its H
query rows. Two launches, the prefixes' and the own rows', each with the row block its segments need; grid
``(segment, row block, split)``: split j takes key blocks ``j, j + P, …`` of the segment (round
robin) and writes its unnormalised accumulator, running max and sum for its rows to a float32 workspace, in the
prefix half or the own half. ``_combine_kernel`` merges, per query row, the splits of its prefix and of its own
segment by log-sum-exp (0 when neither has a key). The rows of each segment are reached through a table of
addresses (``data_ptr``) so no row is copied: the engine's buffers are read where they are.

Reference: ``naive.naive_latent_attention_shared_prefix`` (float64, the rows of each sequence concatenated).
"""

import torch
import triton
import triton.language as tl

from ..launch import fast_launch
from ..utils import cdiv, is_interpreter, next_power_of_2, sm_count
from .decode import COMBINE_BLOCK_R, MAX_SHARED_DIM, NUM_STAGES, PROGRAMS_PER_SM, block_sizes

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@fast_launch
@triton.jit
def _segment_split_kernel(q, key_ptrs, segments, members, acc_ws, m_ws, l_ws, H, NH, P, G, first_segment, qk_scale,
                          R: tl.constexpr, DR: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    i_s, i_m, i_p = first_segment + tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n_keys = tl.load(segments + i_s * 3)
    first = tl.load(segments + i_s * 3 + 1)  # the segment's first entry in `members`
    n_rows = tl.load(segments + i_s * 3 + 2) * H  # its query rows: every head of every member
    if (i_m * BLOCK_M >= n_rows) | (i_p * BLOCK_N >= n_keys):
        return  # nothing here; the combine skips this split too (it recomputes the split count from n_keys)
    rows = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    seq = tl.load(members + first + rows // H, mask=row_ok, other=0)
    q_row = (seq * H + rows % H).to(tl.int64)  # row of q viewed as [N·H, R + DR]
    cols_r = tl.arange(0, R)
    q_tile = tl.load(q + q_row[:, None] * (R + DR) + cols_r[None, :], mask=row_ok[:, None], other=0.)
    if DR > 0:
        cols_d = tl.arange(0, BLOCK_DR)
        d_ok = cols_d < DR
        qr_tile = tl.load(q + q_row[:, None] * (R + DR) + R + cols_d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                          other=0.)
    # the segment's rows live in a buffer of their own ([n_keys, R + DR], contiguous, q's dtype), at this address
    base = tl.load(key_ptrs + i_s).to(tl.pointer_type(q.dtype.element_ty))

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, R], dtype=tl.float32)
    for blk in range(i_p, tl.cdiv(n_keys, BLOCK_N), P):
        keys = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        key_ok = keys < n_keys
        k_off = keys[:, None].to(tl.int64) * (R + DR)
        k_tile = tl.load(base + k_off + cols_r[None, :], mask=key_ok[:, None], other=0.)
        if IEEE:
            s = tl.dot(q_tile, tl.trans(k_tile), input_precision="ieee")
        else:
            s = tl.dot(q_tile, tl.trans(k_tile))
        if DR > 0:  # the shared key part: scores only, never a value
            kr_tile = tl.load(base + k_off + R + cols_d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.)
            if IEEE:
                s += tl.dot(qr_tile, tl.trans(kr_tile), input_precision="ieee")
            else:
                s += tl.dot(qr_tile, tl.trans(kr_tile))
        s = tl.where(key_ok[None, :], s * qk_scale, float("-inf"))  # one decode query: every row is visible
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0., m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, k_tile, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(k_tile.dtype), k_tile)
        m_i = m_new

    half = (i_s >= G).to(tl.int64)  # 0: a prefix segment, 1: a sequence's own rows
    ws_rows = (half * P + i_p) * NH + q_row
    tl.store(acc_ws + ws_rows[:, None] * R + cols_r[None, :], acc, mask=row_ok[:, None])
    tl.store(m_ws + ws_rows, m_i, mask=row_ok)
    tl.store(l_ws + ws_rows, l_i, mask=row_ok)


@fast_launch
@triton.jit
def _combine_kernel(acc_ws, m_ws, l_ws, o, segments, group, H, NH, P, G, R: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr):
    row, i_r = tl.program_id(0), tl.program_id(1)
    n = row // H
    g = tl.load(group + n)  # -1: no prefix
    n_prefix = tl.load(segments + tl.maximum(g, 0) * 3, mask=g >= 0, other=0)
    n_own = tl.load(segments + (G + n) * 3)
    splits = tl.arange(0, BLOCK_P)
    # split j of a segment wrote this row iff its first block j·BLOCK_N holds a key (the split kernel's exit test)
    ok_p = splits < tl.minimum(P, tl.cdiv(n_prefix, BLOCK_N))
    ok_o = splits < tl.minimum(P, tl.cdiv(n_own, BLOCK_N))
    off_p = splits.to(tl.int64) * NH + row
    off_o = (P + splits).to(tl.int64) * NH + row
    m_p = tl.load(m_ws + off_p, mask=ok_p, other=float("-inf"))
    m_o = tl.load(m_ws + off_o, mask=ok_o, other=float("-inf"))
    m_max = tl.maximum(tl.max(m_p, 0), tl.max(m_o, 0))
    m_max = tl.where(m_max == float("-inf"), 0., m_max)
    w_p = tl.exp2(m_p - m_max)
    w_o = tl.exp2(m_o - m_max)
    total = tl.sum(w_p * tl.load(l_ws + off_p, mask=ok_p, other=0.), 0) + \
        tl.sum(w_o * tl.load(l_ws + off_o, mask=ok_o, other=0.), 0)
    cols = i_r * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.sum(w_p[:, None] * tl.load(acc_ws + off_p[:, None] * R + cols[None, :], mask=ok_p[:, None], other=0.), 0)
    acc += tl.sum(w_o[:, None] * tl.load(acc_ws + off_o[:, None] * R + cols[None, :], mask=ok_o[:, None], other=0.),
                  0)
    out = tl.where(total > 0, acc / tl.where(total > 0, total, 1.), 0.)
    tl.store(o + row.to(tl.int64) * R + cols, out.to(o.dtype.element_ty))


def _check_rows(name, t, q):
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[1] != q.shape[2]:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be [L, D] with D = {q.shape[2]} (q's last dim), got {shape}")
    if t.dtype != q.dtype:
        raise ValueError(f"{name} dtype {t.dtype} differs from q dtype {q.dtype}")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device}, expected {q.device} like q")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (its rows are read through its address), got strides "
                         f"{t.stride()}")


def latent_attention_shared_prefix(q, prefixes, group, own, scale, value_dim=None, *, num_splits=None):
    r"""One decode query per sequence over its group's shared prefix rows and its own rows, in the latent space
    (keys = rows, values = their first ``R = value_dim`` columns), each prefix read once for all its members.

    ::

        o[n, h] = Σ_{s ∈ prefixes[group[n]] ∪ own[n]} softmax_s(scale · q[n, h] · row_s) · row_s[:R]

    float32 accumulation; 0 for a sequence with no row at all. Forward only. No row is copied: the kernels read
    each tensor of ``prefixes`` and ``own`` at its address (the tensors must stay alive until the kernels ran,
    as any argument does).

    Args:
        q: ``[N, H, R + Dr]`` float16 / bfloat16 / float32 absorbed queries (``[W_ukᵀ q_nope | q_shared]``).
        prefixes: list of G tensors ``[L_g, R + Dr]`` (q's dtype and device, contiguous): each group's shared rows.
        group: list of N ints, ``group[n]`` in ``[0, G)`` or ``-1`` (no prefix).
        own: list of N tensors ``[L_n, R + Dr]`` (q's dtype and device, contiguous): each sequence's own rows, the
            new token's row included.
        scale: softmax scale (Python float).
        value_dim: ``R``, a power of two in [16, 512]; None → q's whole last dim (then ``Dr = 0``); ``Dr`` at most
            ``MAX_SHARED_DIM``.
        num_splits: splits ``P`` of each segment's keys (None: about ``PROGRAMS_PER_SM`` programs per SM, at most one
            per key block); for tests and tuning.

    Returns:
        ``o [N, H, R]`` in q's dtype.

    Raises:
        ValueError: a wrong rank, shape, dtype, device or contiguity (naming the argument), a ``group`` entry
            outside ``[-1, G)`` or a list of the wrong length, R / Dr outside the kernel's sizes, q requiring grad
            while grad mode is on.
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be [N, H, D], got {getattr(q, 'shape', type(q).__name__)}")
    N, H, D = q.shape
    if q.dtype not in _FLOATS:
        raise ValueError(f"q dtype must be one of {_FLOATS}, got {q.dtype}")
    if q.device.type != "cuda" and not (q.device.type == "cpu" and is_interpreter()):
        raise ValueError(f"q is on {q.device}: the Triton kernels need a CUDA tensor (or CPU with TRITON_INTERPRET=1)")
    R = D if value_dim is None else value_dim
    if isinstance(R, bool) or not isinstance(R, int) or R < 16 or R > 512 or R & (R - 1) or R > D:
        raise ValueError(f"value_dim (the value width R, kv_lora_rank) must be a power of two in [16, 512] and at most "
                         f"q's last dim {D}, got {value_dim!r}")
    if D - R > MAX_SHARED_DIM:
        raise ValueError(f"the shared key part (q's last dim {D} − value_dim {R}) must be at most {MAX_SHARED_DIM} "
                         f"columns, got {D - R}")
    if not isinstance(prefixes, (list, tuple)) or not isinstance(own, (list, tuple)) or \
            not isinstance(group, (list, tuple)):
        raise ValueError("prefixes, group and own must be lists")
    if len(group) != N or len(own) != N:
        raise ValueError(f"group and own must have N = {N} entries (q's first dim), got {len(group)} and {len(own)}")
    G = len(prefixes)
    for i, t in enumerate(prefixes):
        _check_rows(f"prefixes[{i}]", t, q)
    for i, t in enumerate(own):
        _check_rows(f"own[{i}]", t, q)
    bad = [g for g in group if isinstance(g, bool) or not isinstance(g, int) or not -1 <= g < G]
    if bad:
        raise ValueError(f"group entries must be ints in [-1, {G}) (G = len(prefixes)), got {bad[0]!r}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be None or a positive int, got {num_splits!r}")
    if torch.is_grad_enabled() and q.requires_grad:
        raise ValueError("latent_attention_shared_prefix has no backward: q requires grad; run it under "
                         "torch.no_grad()")
    o = q.new_empty(N, H, R)
    if N == 0:
        return o
    # segments: G prefixes (their members in `members`), then one per sequence; rows (n_keys, first member, count)
    members, segments = [], []
    for g in range(G):
        mine = [n for n in range(N) if group[n] == g]
        segments.append((prefixes[g].shape[0], len(members), len(mine)))
        members += mine
    for n in range(N):
        segments.append((own[n].shape[0], len(members), 1))
        members.append(n)
    device = q.device
    host = torch.tensor([t.data_ptr() for t in (*prefixes, *own)], dtype=torch.int64)
    key_ptrs = host.to(device, non_blocking=True)
    seg = torch.tensor(segments, dtype=torch.int32).to(device, non_blocking=True)
    mem = torch.tensor(members, dtype=torch.int32).to(device, non_blocking=True)
    grp = torch.tensor(list(group), dtype=torch.int32).to(device, non_blocking=True)
    # two launches of the split kernel, each with the row block its segments need: the G prefixes (every head of
    # every member: up to members·H rows) and the N own segments (H rows each), so the latter do not pad H rows to
    # the prefixes' block. Both use the same key block (it depends on R only) and the same split count P, which the
    # combine reads.
    launches = [(0, G, max([s[2] for s in segments[:G]], default=0) * H), (G, N, H)]
    blocks = [block_sizes(max(rows, 1), R) for _, _, rows in launches]
    block_n = blocks[0][1]
    programs = sum(count * cdiv(rows, bm) for (_, count, rows), (bm, _, _) in zip(launches, blocks, strict=True))
    max_keys = max(s[0] for s in segments)
    P = num_splits or max(1, min(cdiv(max_keys, block_n), cdiv(PROGRAMS_PER_SM * sm_count(device), max(programs, 1))))
    NH = N * H
    acc_ws = torch.empty(2, P, NH, R, dtype=torch.float32, device=device)
    m_ws = torch.empty(2, P, NH, dtype=torch.float32, device=device)
    l_ws = torch.empty(2, P, NH, dtype=torch.float32, device=device)
    qc = q.contiguous()
    for (first, count, rows), (block_m, _, num_warps) in zip(launches, blocks, strict=True):
        if count == 0 or rows == 0 or max(s[0] for s in segments[first:first + count]) == 0:
            continue  # no key in these segments: the combine sees no split of theirs
        _segment_split_kernel[(count, cdiv(rows, block_m), P)](
            qc, key_ptrs, seg, mem, acc_ws, m_ws, l_ws, H, NH, P, G, first, scale * 1.4426950408889634,
            R=R, DR=D - R, BLOCK_DR=max(16, next_power_of_2(D - R)), BLOCK_M=block_m, BLOCK_N=block_n,
            IEEE=q.dtype == torch.float32, num_warps=num_warps, num_stages=NUM_STAGES)
    block_r = min(R, COMBINE_BLOCK_R)
    _combine_kernel[(NH, R // block_r)](acc_ws, m_ws, l_ws, o, seg, grp, H, NH, P, G, R=R, BLOCK_N=block_n,
                                        BLOCK_P=next_power_of_2(P), BLOCK_R=block_r, num_warps=4)
    return o
