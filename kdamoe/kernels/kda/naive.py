"""Float64 naive recurrence for Kimi Delta Attention (KDA): the ground truth of the kernel tests and benchmarks.

Names follow fla's ``fla.ops.kda.naive`` / ``fla.ops.kda.gate`` (``naive_recurrent_kda``,
``naive_kda_lowerbound_gate``) so a reader can put the two side by side; the code is our own.

Source: Kimi Linear report §3, Eq. 1 (gated delta rule with a per-channel decay; Yang et al.,
"Gated Delta Networks"). Per head, with state ``S ∈ R^{K×V}``::

    S_t = (I − β_t k_t k_tᵀ) · Diag(exp(g_t)) · S_{t−1} + β_t k_t v_tᵀ
    o_t = S_tᵀ (scale · q_t)

Written as a plain per-token loop with the explicit ``K×K`` transition matrix, so that it shares no
algebra with the chunked kernels it checks. Everything is computed in float64 and is differentiable
(autograd gives the reference gradients).
"""

import torch


def naive_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                        cu_seqlens=None):
    """Reference KDA by explicit recurrence, in float64.

    Args:
        q, k: ``[B, T, H, K]`` queries / keys (any float dtype; used as given, no L2 norm).
        v: ``[B, T, H, V]`` values.
        g: ``[B, T, H, K]`` per-channel log decay (``exp(g)`` is the decay; normally in ``[lb, 0]``).
        beta: ``[B, T, H]`` delta-rule step size.
        scale: query scale; ``None`` means ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` state before the first token of each sequence, or None (zeros).
        output_final_state: also return the state after the last token of each sequence.
        cu_seqlens: int ``[N+1]`` cumulative sequence lengths (FlashAttention convention; needs B == 1).
            Each sequence starts from its own initial state.

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, H, V]`` float64, ``final_state`` ``[N, H, K, V]`` float64
        or None.

    Raises:
        ValueError: ``cu_seqlens`` with ``B != 1``.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if scale is None:
        scale = K ** -0.5
    q, k, v, g, beta = (x.to(torch.float64) for x in (q, k, v, g, beta))
    if cu_seqlens is None:
        # every batch row is one sequence
        segments = [(b, 0, T) for b in range(B)]
    else:
        if B != 1:
            raise ValueError(f"cu_seqlens needs B == 1, got B={B}")
        bounds = [int(x) for x in cu_seqlens.tolist()]
        segments = [(0, bounds[n], bounds[n + 1]) for n in range(len(bounds) - 1)]
    N = len(segments)
    o = torch.zeros(B, T, H, V, dtype=torch.float64, device=q.device)
    final = torch.zeros(N, H, K, V, dtype=torch.float64, device=q.device)
    eye = torch.eye(K, dtype=torch.float64, device=q.device)
    for n, (b, start, end) in enumerate(segments):
        for h in range(H):
            if initial_state is not None:
                S = initial_state[n, h].to(torch.float64)
            else:
                S = torch.zeros(K, V, dtype=torch.float64, device=q.device)
            for t in range(start, end):
                kt = k[b, t, h]
                bt = beta[b, t, h]
                # explicit transition (I − β k kᵀ) · Diag(exp g)
                transition = (eye - bt * torch.outer(kt, kt)) @ torch.diag(torch.exp(g[b, t, h]))
                S = transition @ S + bt * torch.outer(kt, v[b, t, h])
                o[b, t, h] = S.T @ (scale * q[b, t, h])
            final[n, h] = S
    return o, (final if output_final_state else None)


def naive_kda_lowerbound_gate(f, A_log, dt_bias, lower_bound=-5.0):
    """Lower-bounded KDA gate in float64: ``g = lb · sigmoid(exp(A_log) · (f + dt_bias))``.

    Args:
        f: ``[B, T, H, K]`` raw gate input.
        A_log: ``[H]`` or None (None means a factor of 1).
        dt_bias: ``[H*K]`` or None (zeros).
        lower_bound: ``lb < 0``.

    Returns:
        ``g`` ``[B, T, H, K]`` float64 in ``[lb, 0]``.
    """
    B, T, H, K = f.shape
    x = f.to(torch.float64)
    if dt_bias is not None:
        x = x + dt_bias.to(torch.float64).view(H, K)
    if A_log is not None:
        x = x * torch.exp(A_log.to(torch.float64)).view(H, 1)
    return lower_bound * torch.sigmoid(x)


def naive_l2norm(x, eps=1e-6):
    """``x * rsqrt(sum(x²) + eps)`` over the last dimension, in the input's dtype (the kernels' q/k norm)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def naive_recurrent_kda_slots(q, k, v, g, beta, state_pool, slot_ids, scale=None, use_qk_l2norm=False,
                              gate=None):
    """Reference of ``fused_recurrent_kda_slots``: gather the slots' states, one step of
    :func:`naive_recurrent_kda` in float64, scatter the new states into a copy of the pool.

    Args:
        q, k, g: ``[N, H, K]``; v: ``[N, H, V]``; beta: ``[N, H]`` (one token per sequence).
        state_pool: ``[num_slots, H, K, V]``; slot_ids: ``[N]`` distinct slots.
        scale: query scale (None: ``K ** -0.5``).
        use_qk_l2norm: L2-normalise q and k first (:func:`naive_l2norm`).
        gate: None (``g`` is the log decay) or ``(A_log, dt_bias, lower_bound)``: ``g`` is the raw gate input,
            turned into the log decay by :func:`naive_kda_lowerbound_gate`.

    Returns:
        ``(o [N, H, V] float64, new_pool [num_slots, H, K, V] float64)``; ``state_pool`` itself is not modified.
    """
    q, k, v, g, beta = (x.to(torch.float64)[:, None] for x in (q, k, v, g, beta))  # N sequences of one token
    if use_qk_l2norm:
        q, k = naive_l2norm(q), naive_l2norm(k)
    if gate is not None:
        A_log, dt_bias, lower_bound = gate
        g = naive_kda_lowerbound_gate(g, A_log, dt_bias, lower_bound)
    pool = state_pool.to(torch.float64).clone()
    ids = slot_ids.long()
    o, final = naive_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=pool[ids], output_final_state=True)
    pool[ids] = final
    return o[:, 0], pool
