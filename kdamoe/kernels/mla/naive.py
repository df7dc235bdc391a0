"""Float64 reference of the MLA latent-space decode over a group's shared prefix plus a sequence's own rows.

Written as a plain per-sequence softmax over the concatenated rows (no blocks, no splits, no shared reads), so that it
shares no algebra with the kernel it checks (``shared_prefix.latent_attention_shared_prefix``). Source: DeepSeek-V2
§2.1.2 (absorbed projections: keys are the cached rows ``[c | k_shared]``, values their first ``R`` columns).
"""

import torch


def naive_latent_attention_shared_prefix(q, prefixes, group, own, scale, value_dim=None):
    """``o[n, h] = softmax(scale · q[n, h] · keysᵀ) · keys[:, :R]`` with ``keys = cat(prefixes[group[n]], own[n])``
    (only ``own[n]`` when ``group[n] == -1``), in float64 on the CPU; 0 for a sequence with no row.

    Args:
        q: ``[N, H, D]``; prefixes: list of ``[L_g, D]``; group: N ints in ``[-1, G)``; own: N tensors ``[L_n, D]``.
        scale: softmax scale; value_dim: ``R`` (None: D).

    Returns:
        ``o [N, H, R]`` float64.
    """
    N, H, D = q.shape
    R = D if value_dim is None else value_dim
    o = torch.zeros(N, H, R, dtype=torch.float64)
    for n in range(N):
        parts = ([prefixes[group[n]]] if group[n] >= 0 else []) + [own[n]]
        keys = torch.cat([p.detach().double().cpu() for p in parts])
        if keys.shape[0] == 0:
            continue
        p = torch.softmax(scale * q[n].detach().double().cpu() @ keys.T, dim=-1)  # [H, L]
        o[n] = p @ keys[:, :R]
    return o
