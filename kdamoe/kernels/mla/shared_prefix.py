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

Static form: :class:`SharedPrefixPlan` holds the tables (addresses, segments, members, groups) in one int64 device
tensor of a fixed capacity (``max_sequences``, ``max_groups``), the float32 workspaces and the output, with a fixed
split count P; ``update`` (or a caller's own copy of ``host_tables``) refills the tables from the host in one
host→device copy and ``launch`` reads only the plan's tensors and q, on grids set by the capacity (a segment with no
key or no row returns at once). A CUDA graph of the rollout engine's decode step captures ``launch``; the rows of the
next step travel in the refilled tables. :func:`latent_attention_shared_prefix` is a plan sized to its call, updated,
launched: one path.

Reference: ``naive.naive_latent_attention_shared_prefix`` (float64, the rows of each sequence concatenated).
"""

import math

import torch
import triton
import triton.language as tl

from ..launch import fast_launch
from ..utils import cdiv, is_interpreter, next_power_of_2, sm_count
from .decode import COMBINE_BLOCK_R, MAX_SHARED_DIM, NUM_STAGES, PROGRAMS_PER_SM, block_sizes, online_softmax_step

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
        acc, m_i, l_i = online_softmax_step(s, k_tile, acc, m_i, l_i, IEEE)

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


def _check_rows(name, t, width, dtype, device):
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[1] != width:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be [L, D] with D = {width} (q's last dim), got {shape}")
    if t.dtype != dtype:
        raise ValueError(f"{name} dtype {t.dtype} differs from q dtype {dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} like q")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (its rows are read through its address), got strides "
                         f"{t.stride()}")


def _check_scale(scale) -> None:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite Python float, got {scale!r}")


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_value_dim(value_dim, D):
    R = D if value_dim is None else value_dim
    if isinstance(R, bool) or not isinstance(R, int) or R < 16 or R > 512 or R & (R - 1) or R > D:
        raise ValueError(f"value_dim (the value width R, kv_lora_rank) must be a power of two in [16, 512] and at most "
                         f"q's last dim {D}, got {value_dim!r}")
    if D - R > MAX_SHARED_DIM:
        raise ValueError(f"the shared key part (q's last dim {D} − value_dim {R}) must be at most {MAX_SHARED_DIM} "
                         f"columns, got {D - R}")
    return R


class SharedPrefixPlan:
    r"""A static launch of :func:`latent_attention_shared_prefix`: device tables and workspaces of a fixed capacity,
    refilled from the host at every step, and launches whose grids depend on the capacity only — what a CUDA graph of
    a decode step can capture (every launch argument is a fixed address or a constant; the rows of the step travel in
    the tables, not in the graph).

    Capacity: ``max_sequences`` query sequences (``N_cap``) and ``max_groups`` prefixes (``G_cap``), each sequence
    one decode query of ``num_heads`` heads. The tables hold ``G_cap + N_cap`` segments: segment ``g < G_cap`` is
    group g's prefix (its members' query rows, one matrix), segment ``G_cap + n`` sequence n's own rows. A segment
    without keys (an unused group, a sequence past the step's ``N``, an empty buffer) has ``n_keys = 0``: its split
    programs return at once and the combine writes 0 for a sequence none of whose segments has a key.

    Tables (one int64 tensor of :meth:`table_size` elements, filled by one host→device copy):
    ``key_ptrs [G_cap + N_cap]`` (each segment's rows' address, ``data_ptr``), ``segments [G_cap + N_cap, 3]``
    (``n_keys``, first entry in ``members``, member count), ``members [2·N_cap]`` (the prefixes' members grouped by
    prefix, then ``n`` at ``N_cap + n``), ``group [N_cap]`` (−1: no prefix).

    Args:
        max_sequences: ``N_cap`` ≥ 1.
        max_groups: ``G_cap`` ≥ 1 (a step's groups each have a member in it, so ``G_cap = N_cap`` always suffices).
        num_heads: ``H`` ≥ 1.
        key_dim: ``D = R + Dr``, the width of q and of every row.
        value_dim: ``R``, a power of two in [16, 512] (None: ``D``); ``D − R`` at most ``MAX_SHARED_DIM``.
        dtype: q's and the rows' dtype (float16 / bfloat16 / float32).
        device: a CUDA device, or the CPU under ``TRITON_INTERPRET=1``.
        num_splits: splits ``P`` of each segment's keys (round robin over its key blocks); None: about
            ``PROGRAMS_PER_SM`` programs per SM over the programs a full step has (``N_cap`` own segments and one
            group holding every sequence), at most 64. Fixed: the workspaces and the grid depend on it.
        tables: where the device tables live: a contiguous 1-D int64 tensor of :meth:`table_size` elements on
            ``device`` (e.g. a slice of a caller's step buffer that the caller fills, with its other inputs, in one
            copy); None allocates it.

    Raises:
        ValueError: a bad capacity, width, dtype, device, ``num_splits`` or ``tables`` (naming it).
    """

    def __init__(self, *, max_sequences, max_groups, num_heads, key_dim, value_dim=None, dtype, device,
                 num_splits=None, tables=None):
        for name, value in (("max_sequences", max_sequences), ("max_groups", max_groups), ("num_heads", num_heads),
                            ("key_dim", key_dim)):
            _positive_int(name, value)
        self.R = _check_value_dim(value_dim, key_dim)
        if dtype not in _FLOATS:
            raise ValueError(f"dtype must be one of {_FLOATS}, got {dtype}")
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as err:
            raise ValueError(f"device {device!r} is not a torch device ({err})") from err
        if device.type != "cuda" and not (device.type == "cpu" and is_interpreter()):
            raise ValueError(f"device {device}: the Triton kernels need a CUDA device (or CPU with TRITON_INTERPRET=1)")
        if num_splits is not None:
            _positive_int("num_splits", num_splits)
        self.max_sequences, self.max_groups = max_sequences, max_groups
        self.num_heads, self.key_dim = num_heads, key_dim
        self.dtype, self.device = dtype, device
        N, G, H, R = max_sequences, max_groups, num_heads, self.R
        # the prefix launch's rows: every head of every member, up to all N_cap sequences in one group; the own
        # launch's: H per sequence (so they do not pad H rows to the prefixes' block)
        self._blocks = (block_sizes(N * H, R), block_sizes(H, R))
        self._block_n = self._blocks[0][1]
        if num_splits is None:
            useful = cdiv(N * H, self._blocks[0][0]) + N * cdiv(H, self._blocks[1][0])
            num_splits = max(1, min(64, cdiv(PROGRAMS_PER_SM * sm_count(device), useful)))
        self.num_splits = P = num_splits
        size = self.table_size(N, G)
        if tables is None:
            tables = torch.zeros(size, dtype=torch.int64, device=device)
        elif not (isinstance(tables, torch.Tensor) and tables.dtype == torch.int64 and tables.shape == (size,)
                  and tables.device == device and tables.is_contiguous()):
            got = (tables.dtype, tuple(tables.shape), tables.device) if isinstance(tables, torch.Tensor) else tables
            raise ValueError(f"tables must be a contiguous int64 tensor of {size} elements on {device}, got {got}")
        self.tables = tables
        S = G + N
        self.key_ptrs, segments, self.members, self.group = tables.split([S, 3 * S, 2 * N, N])
        self.segments = segments.view(S, 3)
        self.acc_ws = torch.empty(2, P, N * H, R, dtype=torch.float32, device=device)
        self.m_ws = torch.empty(2, P, N * H, dtype=torch.float32, device=device)
        self.l_ws = torch.empty(2, P, N * H, dtype=torch.float32, device=device)
        self.out = torch.zeros(N, H, R, dtype=dtype, device=device)
        self._staging = self._copied = None  # update()'s pinned host buffer and the event of its last copy
        self._updated = False
        self._sequences = 0  # sequences of the last update: launch's q must hold at least their rows

    @staticmethod
    def table_size(max_sequences: int, max_groups: int) -> int:
        """Elements (int64) of the tables of a plan of this capacity."""
        return 4 * (max_groups + max_sequences) + 3 * max_sequences

    def host_tables(self, prefixes, group, own) -> list[int]:
        """The tables for one step as a list of :meth:`table_size` ints (the host half of :meth:`update`, for a
        caller that copies them with its other inputs in one transfer to :attr:`tables`).

        Args:
            prefixes: list of ``G ≤ max_groups`` tensors ``[L_g, D]`` (the plan's dtype and device, contiguous).
            group: list of ``N ≤ max_sequences`` ints in ``[-1, G)`` (−1: no prefix).
            own: list of N tensors ``[L_n, D]`` (the plan's dtype and device, contiguous), each sequence's own rows,
                the new token's row included.

        The tensors are read at their addresses when the plan launches: they must stay alive (and in place) until
        then.

        Raises:
            ValueError: a list of the wrong type or length, more sequences or prefixes than the capacity, a tensor of
                the wrong shape, dtype, device or contiguity (naming it), a ``group`` entry outside ``[-1, G)``.
        """
        if not isinstance(prefixes, (list, tuple)) or not isinstance(own, (list, tuple)) or \
                not isinstance(group, (list, tuple)):
            raise ValueError("prefixes, group and own must be lists")
        N, G = len(own), len(prefixes)
        if len(group) != N:
            raise ValueError(f"group and own must have one entry per sequence, got {len(group)} and {N}")
        if N > self.max_sequences:
            raise ValueError(f"{N} sequences exceed the plan's max_sequences={self.max_sequences}")
        if G > self.max_groups:
            raise ValueError(f"{G} prefixes exceed the plan's max_groups={self.max_groups}")
        for i, t in enumerate(prefixes):
            _check_rows(f"prefixes[{i}]", t, self.key_dim, self.dtype, self.device)
        for i, t in enumerate(own):
            _check_rows(f"own[{i}]", t, self.key_dim, self.dtype, self.device)
        bad = [g for g in group if isinstance(g, bool) or not isinstance(g, int) or not -1 <= g < G]
        if bad:
            raise ValueError(f"group entries must be ints in [-1, {G}) (G = len(prefixes)), got {bad[0]!r}")
        N_cap, G_cap = self.max_sequences, self.max_groups
        by_group = [[] for _ in range(G)]
        for n, g in enumerate(group):
            if g >= 0:
                by_group[g].append(n)
        key_ptrs = [t.data_ptr() for t in prefixes] + [0] * (G_cap - G) + [t.data_ptr() for t in own] + \
            [0] * (N_cap - N)
        segments, members = [], []
        for g in range(G):
            segments += (prefixes[g].shape[0], len(members), len(by_group[g]))
            members += by_group[g]
        segments += [0, 0, 0] * (G_cap - G)
        for n in range(N_cap):
            segments += (own[n].shape[0] if n < N else 0, N_cap + n, 1)
        members += [0] * (N_cap - len(members)) + list(range(N_cap))
        return key_ptrs + segments + members + list(group) + [-1] * (N_cap - N)

    def update(self, prefixes, group, own) -> None:
        """Fill the device tables for one step (arguments and errors: :meth:`host_tables`) in one host→device copy;
        on CUDA from the plan's second update on through a pinned buffer of its own (reused once its previous copy
        has run), so a plan made for one call (:func:`latent_attention_shared_prefix`) allocates no pinned memory."""
        values = torch.tensor(self.host_tables(prefixes, group, own), dtype=torch.int64)
        self._sequences = len(own)
        if self.device.type != "cuda" or not self._updated:
            self._updated = True
            self.tables.copy_(values, non_blocking=True)  # from pageable memory: the copy is staged before it returns
            return
        if self._staging is None:
            self._staging = torch.empty(values.shape, dtype=torch.int64, pin_memory=True)
            self._copied = torch.cuda.Event()
        self._copied.synchronize()  # the last copy out of the pinned buffer has run: it may be overwritten
        self._staging.copy_(values)
        self.tables.copy_(self._staging, non_blocking=True)
        self._copied.record()

    def launch(self, q, scale):
        r"""``o = softmax(scale · q · keysᵀ) · keys[:, :R]`` per sequence over the rows the tables name (module
        docstring), float32 accumulation, 0 for a sequence without keys; reads only the plan's device tensors and
        ``q``, so it can be captured in a CUDA graph (the tables are refilled before each replay).

        Args:
            q: ``[N, H, D]`` (the plan's dtype and device), N from the last update's sequence count to
                ``max_sequences``; its first rows are the sequences of the last update (rows past them are
                sequences without keys: output 0).
            scale: softmax scale, a finite Python float / int.

        Returns:
            ``o [N, H, R]``: a view of :attr:`out` (overwritten by the next launch).

        Raises:
            ValueError: a wrong shape, dtype or device of ``q``, fewer rows than the last update's sequences (the
                kernel would read past q), a scale that is not a finite number, q requiring grad while grad mode is
                on.
        """
        N_cap, G_cap, H, D, R = self.max_sequences, self.max_groups, self.num_heads, self.key_dim, self.R
        if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[0] > N_cap or q.shape[1:] != (H, D):
            raise ValueError(f"q must be [N, {H}, {D}] with N <= {N_cap}, got {getattr(q, 'shape', type(q).__name__)}")
        if q.dtype != self.dtype or q.device != self.device:
            raise ValueError(f"q is {q.dtype} on {q.device}, the plan was made for {self.dtype} on {self.device}")
        if q.shape[0] < self._sequences:
            raise ValueError(f"q has {q.shape[0]} rows but the last update named {self._sequences} sequences (one row "
                             "each, at least)")
        _check_scale(scale)
        if torch.is_grad_enabled() and q.requires_grad:
            raise ValueError("latent_attention_shared_prefix has no backward: q requires grad; run it under "
                             "torch.no_grad()")
        N = q.shape[0]
        if N == 0:
            return self.out[:0]
        P, NH = self.num_splits, N_cap * H
        qc = q.contiguous()
        # two launches of the split kernel, each with the row block its segments need (both the same key block, a
        # function of R only, and the same P, which the combine reads); grids from the capacity: the programs of a
        # segment without keys or rows return at once
        for first, count, rows, (block_m, _, num_warps) in ((0, G_cap, N_cap * H, self._blocks[0]),
                                                           (G_cap, N_cap, H, self._blocks[1])):
            _segment_split_kernel[(count, cdiv(rows, block_m), P)](
                qc, self.key_ptrs, self.segments, self.members, self.acc_ws, self.m_ws, self.l_ws, H, NH, P, G_cap,
                first, scale * 1.4426950408889634, R=R, DR=D - R, BLOCK_DR=max(16, next_power_of_2(D - R)),
                BLOCK_M=block_m, BLOCK_N=self._block_n, IEEE=self.dtype == torch.float32, num_warps=num_warps,
                num_stages=NUM_STAGES)
        block_r = min(R, COMBINE_BLOCK_R)
        # only the rows of q's N sequences (the tables give the others no key: they would be 0)
        _combine_kernel[(N * H, R // block_r)](self.acc_ws, self.m_ws, self.l_ws, self.out, self.segments,
                                               self.group, H, NH, P, G_cap, R=R, BLOCK_N=self._block_n,
                                               BLOCK_P=next_power_of_2(P), BLOCK_R=block_r, num_warps=4)
        return self.out[:N]


def latent_attention_shared_prefix(q, prefixes, group, own, scale, value_dim=None, *, num_splits=None):
    r"""One decode query per sequence over its group's shared prefix rows and its own rows, in the latent space
    (keys = rows, values = their first ``R = value_dim`` columns), each prefix read once for all its members.

    ::

        o[n, h] = Σ_{s ∈ prefixes[group[n]] ∪ own[n]} softmax_s(scale · q[n, h] · row_s) · row_s[:R]

    float32 accumulation; 0 for a sequence with no row at all. Forward only. No row is copied: the kernels read
    each tensor of ``prefixes`` and ``own`` at its address (the tensors must stay alive until the kernels ran,
    as any argument does). A :class:`SharedPrefixPlan` sized to this call (``N`` sequences, ``G`` prefixes),
    updated, launched: the one path the rollout engine's captured steps take too.

    Args:
        q: ``[N, H, R + Dr]`` float16 / bfloat16 / float32 absorbed queries (``[W_ukᵀ q_nope | q_shared]``).
        prefixes: list of G tensors ``[L_g, R + Dr]`` (q's dtype and device, contiguous): each group's shared rows.
        group: list of N ints, ``group[n]`` in ``[0, G)`` or ``-1`` (no prefix).
        own: list of N tensors ``[L_n, R + Dr]`` (q's dtype and device, contiguous): each sequence's own rows, the
            new token's row included.
        scale: softmax scale, a finite Python float / int.
        value_dim: ``R``, a power of two in [16, 512]; None → q's whole last dim (then ``Dr = 0``); ``Dr`` at most
            ``MAX_SHARED_DIM``.
        num_splits: splits ``P`` of each segment's keys (None: about ``PROGRAMS_PER_SM`` programs per SM, at most one
            per key block of the longest segment); for tests and tuning.

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
    R = _check_value_dim(value_dim, D)
    if not isinstance(prefixes, (list, tuple)) or not isinstance(own, (list, tuple)) or \
            not isinstance(group, (list, tuple)):
        raise ValueError("prefixes, group and own must be lists")
    if len(group) != N or len(own) != N:
        raise ValueError(f"group and own must have N = {N} entries (q's first dim), got {len(group)} and {len(own)}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be None or a positive int, got {num_splits!r}")
    _check_scale(scale)
    if torch.is_grad_enabled() and q.requires_grad:
        raise ValueError("latent_attention_shared_prefix has no backward: q requires grad; run it under "
                         "torch.no_grad()")
    if N == 0:
        return q.new_empty(0, H, R)
    G = len(prefixes)
    if num_splits is None:  # sized to this call's data: the programs it has, at most one split per key block
        members = [sum(g == i for g in group) for i in range(G)] if G else [0]
        (bm_p, block_n, _), (bm_o, _, _) = block_sizes(max(max(members), 1) * H, R), block_sizes(H, R)
        programs = sum(cdiv(m * H, bm_p) for m in members) + N * cdiv(H, bm_o)
        lengths = [t.shape[0] for t in (*prefixes, *own) if isinstance(t, torch.Tensor) and t.dim() == 2]
        num_splits = max(1, min(cdiv(max(lengths, default=0), block_n),
                                cdiv(PROGRAMS_PER_SM * sm_count(q.device), max(programs, 1))))
    plan = SharedPrefixPlan(max_sequences=N, max_groups=max(G, 1), num_heads=H, key_dim=D, value_dim=R, dtype=q.dtype,
                            device=q.device, num_splits=num_splits)
    plan.update(prefixes, group, own)
    return plan.launch(q, scale)
