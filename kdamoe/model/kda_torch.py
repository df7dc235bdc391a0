"""Pure-PyTorch Kimi Delta Attention: the gate (lower-bounded, or Kimi Linear's unbounded one), the chunked form and
the recurrent step.

This is the reference path the modeling file runs on a CPU (and from a saved folder with nothing but
torch + transformers), and the path the Triton kernels are checked against. Signatures follow fla's
``chunk_kda`` / ``fused_recurrent_kda``, including the in-kernel gate (``use_gate_in_kernel``, ``dt_bias``,
``A_log``, ``lower_bound``), so every backend takes the same call (docs/architecture.md §6).

Math (Kimi Linear report §3, Eq. 1), per head with state ``S ∈ R^{K×V}``::

    S_t = (I − β_t k_t k_tᵀ) Diag(exp(g_t)) S_{t−1} + β_t k_t v_tᵀ,      o_t = S_tᵀ (scale · q_t)

Chunked (WY / UT) form, per chunk with start state ``S0`` and in-chunk cumulative gate ``G``
(Yang et al., "Gated Delta Networks", §3; the per-channel decay of KDA)::

    A_kk[i, j] = β_i Σ_d k_id k_jd exp(G_id − G_jd)     (j < i)
    M  = (I + A_kk)^-1,   u = M (β ⊙ v),   w = M (β ⊙ k ⊙ exp(G)),   δ = u − w S0
    o  = (q ⊙ exp(G)) S0 + Tril(A_qk) δ,   A_qk[i, j] = Σ_d q_id k_jd exp(G_id − G_jd)   (j ≤ i)
    S_end = exp(G_C) ⊙ S0 + (k ⊙ exp(G_C − G))ᵀ δ

The in-chunk factors ``exp(G_i − G_j)`` are formed directly (``j ≤ i``, so the exponent is ≤ 0 for any
``g ≤ 0``): this path never needs the lower bound to be exact; the bound matters for the Triton kernels.
"""

import math
from itertools import pairwise

import torch
import torch.nn.functional as F


def kda_gate(
    f: torch.Tensor, dt_bias: torch.Tensor | None, lower_bound: float | None, A_log: torch.Tensor | None = None
) -> torch.Tensor:
    """KDA log-decay ``g`` from the raw gate input, in one of two forms (docs/architecture.md §1):

    * ``lower_bound`` a float: the lower-bounded gate ``g = lower_bound · σ(exp(A_log) · (f + dt_bias))`` ∈
      [lower_bound, 0);
    * ``lower_bound`` None: Kimi Linear's unbounded gate ``g = −exp(A_log) · softplus(f + dt_bias)`` ∈ (−∞, 0].

    Args:
        f: raw gate input ``[..., H, K]`` (any float dtype).
        dt_bias: ``[H*K]`` bias, or None for none.
        lower_bound: ``g_min`` (negative; docs/architecture.md §1 explains the −5 limit), or None for the unbounded
            gate.
        A_log: optional ``[H]`` per-head log scale; ``None`` means scale 1.

    Returns:
        ``g`` with ``f``'s shape, float32 (float64 for float64 ``f``; gate exponentials are never taken in
        half precision).

    ``softplus`` is torch's (``x`` above 20, else ``log1p(exp(x))``; 40 for float64): the threshold of fla's kernel and
    of transformers' ``KimiLinearForgetGate``; past it ``log1p(exp(x)) − x < e^−20`` is below half an ulp of ``x`` in
    float32, and below it ``log1p`` never overflows and keeps the tiny values that ``log(1 + exp(x))`` rounds to 0 (a
    difference under ``6·10⁻⁸·exp(A_log)`` in ``g``).

    Source: the lower-bounded sigmoid log-decay of the Kimi K3 recipe; the softplus gate of the Kimi Linear report §3
    (as fla's ``chunk_kda`` computes it with ``lower_bound=None``).
    """
    num_heads, head_dim = f.shape[-2], f.shape[-1]
    dtype = torch.float64 if f.dtype == torch.float64 else torch.float32
    x = f.to(dtype)
    if dt_bias is not None:
        x = x + dt_bias.to(dtype).view(num_heads, head_dim)
    scale = A_log.to(dtype).exp().view(num_heads, 1) if A_log is not None else None
    if lower_bound is None:
        # Past the threshold softplus(x) = x to within half an ulp: 20 in float32 (fla's and transformers' value),
        # 40 in float64 (e^-40 < 2^-53).
        g = F.softplus(x, threshold=40.0 if dtype == torch.float64 else 20.0)
        return -g if scale is None else -scale * g
    if scale is not None:
        x = x * scale
    return lower_bound * torch.sigmoid(x)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(Σ x² + eps)`` over the last dim, computed in float32, returned in ``x.dtype``."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens):
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, H, K]; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    B, T, H, _ = q.shape
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V]; got {tuple(v.shape)}")
    if g.shape != q.shape:
        raise ValueError(f"g must have q's shape {tuple(q.shape)}; got {tuple(g.shape)}")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must be [B, T, H] = [{B}, {T}, {H}]; got {tuple(beta.shape)}")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch must be packed into B = 1; got B = {B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != T:
            raise ValueError(f"cu_seqlens must be 1-D, start at 0 and end at T = {T}; got {cu_seqlens.tolist()}")
        if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
            raise ValueError(f"cu_seqlens must be non-decreasing; got {cu_seqlens.tolist()}")
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is not None and initial_state.shape != (N, H, q.shape[-1], v.shape[-1]):
        raise ValueError(
            f"initial_state must be [N, H, K, V] = [{N}, {H}, {q.shape[-1]}, {v.shape[-1]}]; "
            f"got {tuple(initial_state.shape)}"
        )


def _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens, gate):
    """Validate, compute the gate if asked, L2-normalise q/k if asked, scale q and flatten to ``[B*T, H, ...]``
    in the compute dtype. ``gate`` is ``(use_gate_in_kernel, A_log, dt_bias, lower_bound)``.

    Returns ``(dtype, q, k, v, g, beta)``; the compute dtype is float64 for float64 inputs, else float32.
    """
    _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    use_gate_in_kernel, A_log, dt_bias, lower_bound = gate
    if use_gate_in_kernel:
        if lower_bound is not None and (isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float))
                                        or not -5.0 <= lower_bound < 0):
            raise ValueError(f"use_gate_in_kernel needs lower_bound in [-5, 0) or None (unbounded gate); got "
                             f"{lower_bound!r}")
        g = kda_gate(g, dt_bias, lower_bound, A_log)
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q, k, v, g, beta = (x.to(dtype).flatten(0, 1) for x in (q, k, v, g, beta))
    return dtype, q * scale, k, v, g, beta


def _sequence_bounds(B: int, T: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int]]:
    """(start, end) of every sequence in the flattened ``[B*T]`` token axis."""
    if cu_seqlens is None:
        return [(b * T, (b + 1) * T) for b in range(B)]
    bounds = cu_seqlens.tolist()
    return list(pairwise(bounds))


def chunk_kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 32,
    *,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA in PyTorch (differentiable in every input), fla ``chunk_kda`` signature.

    Args:
        q, k: ``[B, T, H, K]``.
        v: ``[B, T, H, V]``.
        g: ``[B, T, H, K]`` log-decay (≤ 0; any value ≤ 0 is handled exactly).
        beta: ``[B, T, H]`` write strength in [0, 1].
        scale: query scale; default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` (N = B, or the number of sequences with ``cu_seqlens``).
        output_final_state: also return the ``[N, H, K, V]`` float32 final state.
        use_qk_l2norm_in_kernel: L2-normalise q and k first.
        cu_seqlens: ``[N+1]`` int cumulative lengths of packed sequences (B must be 1).
        chunk_size: tokens per chunk (memory ``O(T · chunk_size · K)`` per head).
        use_gate_in_kernel: ``g`` is the raw gate input f and the gate
            ``g = lower_bound · σ(exp(A_log) · (f + dt_bias))`` (or, for ``lower_bound=None``, the unbounded
            ``g = −exp(A_log) · softplus(f + dt_bias)``) is computed here (:func:`kda_gate`), as the kernels do it
            in-kernel; A_log ``[H]`` / dt_bias ``[H*K]`` may be None (factor 1 / no bias).
        lower_bound: ``g_min`` in [-5, 0), or None for the unbounded gate, with ``use_gate_in_kernel``.

    Returns:
        ``(o [B, T, H, V] in v.dtype, final_state [N, H, K, V] float32 (float64 for float64 inputs) or None)``.
        Computed in float32 (float64 when the inputs are float64).

    Raises:
        ValueError: for inconsistent shapes, a bad ``cu_seqlens`` or ``lower_bound``.
    """
    B, T, H, K = q.shape
    V, out_dtype = v.shape[-1], v.dtype
    gate = (use_gate_in_kernel, A_log, dt_bias, lower_bound)
    dtype, q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
                                       gate)

    # Lay every sequence out in whole chunks; padded slots have g = β = k = v = q = 0, which leaves the
    # state untouched and produces nothing, so the padding is exact.
    C = chunk_size
    bounds = _sequence_bounds(B, T, cu_seqlens)
    src, dst, first_chunk, num_chunks = [], [], [], []
    offset = 0
    for start, end in bounds:
        src.append(torch.arange(start, end))
        dst.append(torch.arange(offset, offset + end - start))
        first_chunk.append(offset // C)
        num_chunks.append(math.ceil((end - start) / C))
        offset += num_chunks[-1] * C
    src = torch.cat(src).to(q.device)
    dst = torch.cat(dst).to(q.device)

    def to_chunks(x):
        padded = x.new_zeros(offset, *x.shape[1:]).index_copy(0, dst, x.index_select(0, src))
        return padded.view(-1, C, *x.shape[1:]).transpose(1, 2)  # [NC, H, C, ...]

    qc, kc, vc, gc, bc = map(to_chunks, (q, k, v, g, beta))
    intra = _intra_chunk(qc, kc, vc, gc, bc)

    # Inter-chunk pass, the only sequential part: step j advances the j-th chunk of every sequence that
    # has one, all at once. Sequences are sorted by chunk count so the active ones are a prefix.
    N = len(bounds)
    seq_order = sorted(range(N), key=lambda n: -num_chunks[n])
    active = [sum(1 for n in seq_order if num_chunks[n] > j) for j in range(max(num_chunks, default=0))]
    chunk_perm = torch.tensor(
        [first_chunk[n] + j for j, m in enumerate(active) for n in seq_order[:m]], dtype=torch.long, device=q.device
    )
    # One gather and one split per tensor: cheap in backward (no per-chunk full-size zero gradients).
    u, w, A_qk, q_decay, k_decay, decay_last = (x.index_select(0, chunk_perm).split(active) for x in intra)
    state0 = q.new_zeros(N, H, K, V) if initial_state is None else initial_state.to(dtype)
    seq_perm = torch.tensor(seq_order, dtype=torch.long, device=q.device)
    state = state0.index_select(0, seq_perm)
    outputs = []
    for j, m in enumerate(active):
        s = state[:m]
        delta = u[j] - w[j] @ s  # [m, H, C, V]
        outputs.append(q_decay[j] @ s + A_qk[j] @ delta)
        s = decay_last[j].unsqueeze(-1) * s + k_decay[j].transpose(-1, -2) @ delta
        state = torch.cat([s, state[m:]]) if m < N else s
    o_perm = torch.cat(outputs) if outputs else q.new_zeros(0, H, C, V)
    o_chunks = torch.empty_like(o_perm).index_copy(0, chunk_perm, o_perm)
    o_flat = o_chunks.transpose(1, 2).reshape(offset, H, V)
    o = o_flat.new_zeros(B * T, H, V).index_copy(0, src, o_flat.index_select(0, dst))
    final_state = None
    if output_final_state:  # sequences never active keep their initial state
        final_state = torch.empty_like(state).index_copy(0, seq_perm, state).to(dtype)
    return o.view(B, T, H, V).to(out_dtype), final_state


def _intra_chunk(q, k, v, g, beta):
    """Everything inside a chunk that does not depend on the incoming state.

    Args: q, k, g ``[NC, H, C, K]``, v ``[NC, H, C, V]``, beta ``[NC, H, C]`` (q already scaled).

    Returns: ``u [NC,H,C,V]``, ``w [NC,H,C,K]``, ``A_qk [NC,H,C,C]`` (lower incl.), ``q ⊙ exp(G)``,
    ``k ⊙ exp(G_C − G)``, ``exp(G_C) [NC,H,K]``.
    """
    C = q.shape[-2]
    G = g.cumsum(-2)
    # exp(G_i − G_j) for j ≤ i only: mask the exponent before exp so future columns are exactly 0.
    diff = G.unsqueeze(-2) - G.unsqueeze(-3)  # [NC, H, C(i), C(j), K]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    gamma = diff.masked_fill(~causal[..., None], float("-inf")).exp()
    A_qk = torch.einsum("nhik,nhjk,nhijk->nhij", q, k, gamma)
    A_kk = torch.einsum("nhik,nhjk,nhijk->nhij", k, k, gamma).tril(-1) * beta.unsqueeze(-1)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    # M = (I + A_kk)^-1 applied by a unit-lower-triangular solve.
    rhs = torch.cat([beta.unsqueeze(-1) * v, beta.unsqueeze(-1) * k * G.exp()], dim=-1)
    uw = torch.linalg.solve_triangular(eye + A_kk, rhs, upper=False, unitriangular=True)
    u, w = uw.split([v.shape[-1], k.shape[-1]], dim=-1)
    G_last = G[..., -1, :]
    return u, w, A_qk, q * G.exp(), k * (G_last.unsqueeze(-2) - G).exp(), G_last.exp()


def recurrent_kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA (the decode path), fla ``fused_recurrent_kda`` signature.

    Same arguments (less ``chunk_size``), shapes, return values and errors as :func:`chunk_kda_torch`; cost ``O(T)``
    sequential steps, meant for ``T = 1`` decoding. Each step applies
    ``S ← Diag(exp(g_t)) S;  S ← S + β_t k_t (v_t − Sᵀ k_t)ᵀ;  o_t = Sᵀ (scale·q_t)``.
    """
    B, T, H, K = q.shape
    V, out_dtype = v.shape[-1], v.dtype
    gate = (use_gate_in_kernel, A_log, dt_bias, lower_bound)
    dtype, q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
                                       gate)
    bounds = _sequence_bounds(B, T, cu_seqlens)
    N = len(bounds)
    state0 = q.new_zeros(N, H, K, V) if initial_state is None else initial_state.to(dtype)
    outputs, finals = [], []
    for n, (start, end) in enumerate(bounds):
        state = state0[n]
        for t in range(start, end):
            state = g[t].exp().unsqueeze(-1) * state
            kt = k[t].unsqueeze(-1)  # [H, K, 1]
            residual = v[t] - (state * kt).sum(-2)  # [H, V]
            state = state + beta[t][:, None, None] * kt * residual.unsqueeze(-2)
            outputs.append((state * q[t].unsqueeze(-1)).sum(-2))
        finals.append(state)
    o = torch.stack(outputs) if outputs else q.new_zeros(0, H, V)
    final_state = torch.stack(finals).to(dtype) if output_final_state else None
    return o.view(B, T, H, V).to(out_dtype), final_state


def causal_conv1d_torch(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None = None, seq_idx: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution followed by SiLU, restarting at sequence boundaries.

    ``y[b, t, c] = SiLU(Σ_{j<W} weight[c, W−1−j] · x[b, t−j, c] · [seq_idx[b, t−j] = seq_idx[b, t]])`` (tap j
    looks j steps back; the short conv of Mamba, Gu & Dao 2023 §3.4, and of the KDA layer, Kimi Linear
    report §3). Differentiable in x, weight and conv_state.

    Args:
        x: ``[B, T, C]`` input channels.
        weight: ``[C, W]`` depthwise kernel (``nn.Conv1d(groups=C).weight.squeeze(1)``).
        conv_state: ``[B, C, W]`` the last ``W`` inputs before ``x`` (from the cache), or None for zeros.
        seq_idx: ``[B, T]`` int sequence id per token; a token never sees inputs of another id, and
            the cached ``conv_state`` only feeds tokens of the row's first id.

    Returns:
        ``(SiLU(conv(x)) [B, T, C], new_state [B, C, W])``, both in ``x.dtype`` (computed in float32, float64
        for float64 inputs). The state holds the last ``W`` inputs of each row, zero where an input belongs
        to another sequence than the row's last token (the cache continues only that sequence).
    """
    B, T, C = x.shape
    W = weight.shape[-1]
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    history = x.new_zeros(B, W, C) if conv_state is None else conv_state.transpose(1, 2).to(x.dtype)
    full = torch.cat([history, x], dim=1)  # [B, W + T, C]
    if seq_idx is not None:
        # Inputs from the cache belong to the first sequence of the row.
        ids = torch.cat([seq_idx[:, :1].expand(B, W), seq_idx], dim=1)
    out = x.new_zeros(B, T, C, dtype=dtype)
    for j in range(W):  # tap j looks j steps back
        shifted = full[:, W - j : W - j + T].to(dtype)
        if seq_idx is not None:
            shifted = shifted * (ids[:, W - j : W - j + T] == seq_idx).unsqueeze(-1)
        out = out + shifted * weight[:, W - 1 - j].to(dtype)
    return F.silu(out).to(x.dtype), conv_final_state(x, conv_state, seq_idx, W)


def conv_final_state(
    x: torch.Tensor, conv_state: torch.Tensor | None, seq_idx: torch.Tensor | None, width: int
) -> torch.Tensor:
    """The state :func:`causal_conv1d_torch` returns: the last ``width`` inputs of each row, ``[B, C, W]``.

    Slots before the row's start come from ``conv_state`` (zeros when None); a slot holding an input of
    another sequence than the row's last token is zero. Differentiable; in ``x.dtype``.
    """
    B, T, C = x.shape
    tail = x[:, max(T - width, 0) :]
    history = x.new_zeros(B, width, C) if conv_state is None else conv_state.transpose(1, 2).to(x.dtype)
    state = torch.cat([history, tail], dim=1)[:, -width:]
    if seq_idx is not None and T > 0:
        ids = torch.cat([seq_idx[:, :1].expand(B, width), seq_idx[:, max(T - width, 0) :]], dim=1)[:, -width:]
        state = state * (ids == seq_idx[:, -1:]).unsqueeze(-1)
    return state.transpose(1, 2)
