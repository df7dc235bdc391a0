"""Peers for the MoE benchmark: a ``torch._grouped_mm`` pipeline and a per-expert eager loop.

Both compute the same function as ``moe_route`` + ``moe_experts`` (sigmoid router with balancing bias,
Top-k of s + b, gate weights s/Σs, SiTU-GLU experts in transformers' layout, weighted combine) and use
autograd for the backward. Written for this project (DESIGN.md §6, "The MoE benchmark's peer").
"""

import torch


def situ_glu_torch(a, b, beta1=4.0, beta2=25.0):
    """SiTU-GLU in float32, result in ``a``'s dtype (Kimi K3 report §2.3)."""
    af, bf = a.float(), b.float()
    return (beta1 * torch.tanh(af / beta1) * torch.sigmoid(af) * (beta2 * torch.tanh(bf / beta2))).to(a.dtype)


def sigmoid_topk(logits, bias, top_k):
    """Router: s = σ(logits) (float32), T = Top-k(s + b), weights s_T / Σ s_T. Returns (index, weights)."""
    s = torch.sigmoid(logits.float())
    idx = torch.topk(s + bias, top_k, dim=-1).indices
    sel = s.gather(1, idx)
    return idx, sel / sel.sum(-1, keepdim=True)


def grouped_mm_experts(x, idx, w, gate_up_proj, down_proj):
    """Permutation + two ``torch._grouped_mm`` + SiTU between + weighted combine (index == E skipped)."""
    num_experts = gate_up_proj.shape[0]
    k = idx.shape[1]
    flat = idx.flatten()
    order = flat.argsort(stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=x.device)
    counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts[:num_experts].cumsum(0).to(torch.int32)
    # rows routed to index E sort last, past offs[-1]: grouped_mm does not define them, so mask them below
    tok = order // k
    xs = x[tok]
    inter = gate_up_proj.shape[1] // 2
    h = torch._grouped_mm(xs, gate_up_proj.transpose(1, 2), offs=offs)
    g = situ_glu_torch(h[:, :inter], h[:, inter:])
    y = torch._grouped_mm(g, down_proj.transpose(1, 2), offs=offs)
    valid = (flat[order] < num_experts).unsqueeze(-1)
    y = torch.where(valid, y * w.flatten()[order].unsqueeze(-1).to(y.dtype), torch.zeros((), dtype=y.dtype,
                                                                                          device=y.device))
    out = torch.zeros_like(x)
    return out.index_add(0, tok, y)


def grouped_mm_moe(x, logits, bias, gate_up_proj, down_proj, top_k):
    idx, w = sigmoid_topk(logits, bias, top_k)
    return grouped_mm_experts(x, idx, w, gate_up_proj, down_proj)


def loop_experts(x, idx, w, gate_up_proj, down_proj):
    """One matmul pair per expert that received tokens (the simple eager baseline; index == E skipped)."""
    num_experts = gate_up_proj.shape[0]
    k = idx.shape[1]
    flat = idx.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts].tolist()
    tok = order // k
    wf = w.flatten()
    inter = gate_up_proj.shape[1] // 2
    out = torch.zeros_like(x)
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        rows = order[start:start + c]
        t = tok[start:start + c]
        start += c
        h = x[t] @ gate_up_proj[e].t()
        y = situ_glu_torch(h[:, :inter], h[:, inter:]) @ down_proj[e].t()
        out = out.index_add(0, t, y * wf[rows].unsqueeze(-1).to(y.dtype))
    return out


def loop_moe(x, logits, bias, gate_up_proj, down_proj, top_k):
    idx, w = sigmoid_topk(logits, bias, top_k)
    return loop_experts(x, idx, w, gate_up_proj, down_proj)
