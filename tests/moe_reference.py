"""Plain float64 references for the MoE kernels (loops over tokens and experts; no Triton)."""

import torch


def glu_ref(a, b, activation="situ", beta1=4.0, beta2=25.0):
    if activation == "situ":
        return beta1 * torch.tanh(a / beta1) * torch.sigmoid(a) * (beta2 * torch.tanh(b / beta2))
    return a * torch.sigmoid(a) * b


def moe_experts_ref(x, idx, w, w1, w2, activation="situ", beta1=4.0, beta2=25.0):
    """out[t] = Σ_j w[t,j]·W2[e] GLU(W1[e] x[t]) in float64, slots with idx == E skipped; autograd-able."""
    x, w, w1, w2 = (t.double() for t in (x, w, w1, w2))
    n, k = idx.shape
    e_num, two_i, _ = w1.shape
    inter = two_i // 2
    rows = []
    for t in range(n):
        acc = torch.zeros_like(x[t])
        for j in range(k):
            e = int(idx[t, j])
            if e == e_num:
                continue
            h = w1[e] @ x[t]
            acc = acc + w[t, j] * (w2[e] @ glu_ref(h[:inter], h[inter:], activation, beta1, beta2))
        rows.append(acc)
    return torch.stack(rows)


def moe_route_ref(logits, bias, top_k, scaling=1.0):
    """Top-(k+1) of sigmoid(logits)+bias in float64: (index [N,k], weights [N,k], alpha [N], scores [N,E])."""
    s = torch.sigmoid(logits.double())
    biased = s + bias.double()
    vals, ids = torch.topk(biased, top_k + 1, dim=-1)
    sel = ids[:, :top_k]
    ss = s.gather(1, sel)
    return sel, scaling * ss / ss.sum(-1, keepdim=True), vals[:, top_k], s


def histogram_ref(r, lo, hi, num_bins=1024):
    """Per-expert counts [E, num_bins] of r [N, E] (float64) over [lo, hi], outside values clamped."""
    width = (hi - lo) / num_bins
    b = torch.floor((r - lo) / width).clamp(0, num_bins - 1).long()
    e = r.shape[1]
    out = torch.zeros(e, num_bins, dtype=torch.long)
    for j in range(e):
        out[j] = torch.bincount(b[:, j], minlength=num_bins)
    return out


def margins_ref(s, bias, sel, top_k):
    """QB statistic r = τ − s in float64: τ = (k+1)-th biased score for the selected experts ``sel``,
    the k-th biased score for the others (what each expert has to beat to be picked)."""
    biased = s.double() + bias.double()
    top = torch.topk(biased, top_k + 1, dim=-1).values
    selected = torch.zeros_like(biased, dtype=torch.bool).scatter_(1, sel, True)
    return torch.where(selected, top[:, top_k : top_k + 1], top[:, top_k - 1 : top_k]) - s.double()
