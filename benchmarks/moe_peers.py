"""The MoE benchmark's peer: routed experts through ``torch._grouped_mm`` (written for this project).

Computes the same function as ``moe_route`` + ``moe_experts``: the model's PyTorch router op
(``kdamoe.model.moe_torch.moe_route_torch``: sigmoid router with balancing bias, Top-k of s + b, gate weights
s/Σs), SiTU-GLU experts in transformers' layout ``gate_up_proj [E, 2I, ℓ]``, ``down_proj [E, ℓ, I]``,
weighted combine; autograd gives the backward. The per-expert loop baseline is the model's own PyTorch
path (``kdamoe.model.moe_torch.moe_experts_torch``).
"""

import torch

from kdamoe.model.moe_torch import moe_route_torch, situ_glu


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
    g = situ_glu(h[:, :inter], h[:, inter:])
    y = torch._grouped_mm(g, down_proj.transpose(1, 2), offs=offs)
    valid = (flat[order] < num_experts).unsqueeze(-1)
    y = torch.where(valid, y * w.flatten()[order].unsqueeze(-1).to(y.dtype), torch.zeros((), dtype=y.dtype,
                                                                                          device=y.device))
    out = torch.zeros_like(x)
    return out.index_add(0, tok, y)


def grouped_mm_moe(x, logits, bias, gate_up_proj, down_proj, top_k):
    """Router op + :func:`grouped_mm_experts`; ``logits [N, E]``, ``bias [E]`` float32."""
    idx, w, _, _ = moe_route_torch(logits, bias, top_k)
    return grouped_mm_experts(x, idx, w, gate_up_proj, down_proj)
