"""Pure-PyTorch pieces of the Stable LatentMoE: the router op, the SiTU-GLU activation and the routed experts.

These are the ops ``kernel_dispatch`` picks when the Triton kernels do not run (CPU, ``kernel_backend="torch"``,
remote code without ``kdamoe.kernels``); each has the signature of its kernel.

SiTU-GLU (Kimi K3 report §2.3)::

    SiTU-GLU(a, b) = [β1·tanh(a/β1) · σ(a)] ⊙ [β2·tanh(b/β2)]

Both branches are soft-capped, so ``|SiTU-GLU| < β1·β2``; near 0, ``β·tanh(x/β) ≈ x`` and it equals
SwiGLU ``a·σ(a) ⊙ b``.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .quantile_balancing import histogram_range, qb_histogram, selection_margins


def moe_route_torch(
    router_logits: torch.Tensor,
    e_score_correction_bias: torch.Tensor,
    top_k: int,
    routed_scaling_factor: float = 1.0,
    token_mask: torch.Tensor | None = None,
    count_tokens: bool = False,
    num_bins: int | None = None,
):
    """Sigmoid router with a selection-only bias: Top-(k+1), gate weights and the balancing statistics.

    ``s = σ(logits)``, ``T ∪ {c} = Top-(k+1)(s + b)``, ``p_j = c · s_j / Σ_{r∈T} s_r`` (Kimi K3 report §2.3;
    DeepSeek-V3 loss-free balancing, arXiv:2412.19437 §2.1.2: the bias picks experts, the weights use the
    unbiased scores). The PyTorch twin of ``kdamoe.kernels.moe_route`` (same signature and outputs).

    Args:
        router_logits: ``[N, E]`` float logits.
        e_score_correction_bias: ``[E]`` float32 bias ``b`` (no gradient).
        top_k: experts per token, ``1 <= k < E`` (Quantile Balancing needs the (k+1)-th score).
        routed_scaling_factor: the factor ``c`` of the gate weights.
        token_mask: optional ``[N]`` bool; False tokens (padding) are routed but left out of the statistics.
        count_tokens: also return the counted tokens per expert.
        num_bins: also return the QB histogram of the selection margins ``r = τ − s``
            (``quantile_balancing.selection_margins``) with this many bins per expert; None: no histogram.

    Returns:
        ``(top_k_index [N, k] int64, top_k_weights [N, k] float32, tokens_per_expert [E] float64 or None,
        histogram [E, num_bins] float64 or None)``. ``top_k_weights`` is differentiable w.r.t. the logits.

    Raises:
        ValueError: ``top_k`` outside ``[1, E − 1]``.
    """
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k < num_experts:
        raise ValueError(f"top_k must satisfy 1 <= top_k < num_experts={num_experts}, got {top_k}")
    scores = torch.sigmoid(router_logits.float())
    biased = scores.detach() + e_score_correction_bias
    top_values, top_index = biased.topk(top_k + 1, dim=-1)
    top_k_index = top_index[:, :top_k]
    top_k_weights = scores.gather(1, top_k_index)
    top_k_weights = top_k_weights / top_k_weights.sum(-1, keepdim=True) * routed_scaling_factor
    tokens_per_expert = histogram = None
    if count_tokens or num_bins is not None:
        with torch.no_grad():
            s, values, index = scores.detach(), top_values, top_k_index
            if token_mask is not None:
                keep = token_mask.bool()
                s, values, index = s[keep], values[keep], index[keep]
            if count_tokens:
                tokens_per_expert = torch.bincount(index.flatten(), minlength=num_experts).double()
            if num_bins is not None:
                lo, hi = histogram_range(e_score_correction_bias)
                histogram = qb_histogram(selection_margins(s, values, index), lo, hi, num_bins)
    return top_k_index, top_k_weights, tokens_per_expert, histogram


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """SiTU-GLU of the gate branch ``gate`` and the linear branch ``up`` (same shape).

    Computed in float32 (float64 for float64 inputs); returns ``gate``'s dtype and shape, with
    ``|out| ≤ beta · linear_beta`` (strictly below until tanh rounds to 1).
    """
    compute = torch.promote_types(gate.dtype, torch.float32)
    a, b = gate.to(compute), up.to(compute)
    out = beta * torch.tanh(a / beta) * torch.sigmoid(a) * (linear_beta * torch.tanh(b / linear_beta))
    return out.to(gate.dtype)


class GLUActivation(nn.Module):
    """Two-branch activation ``act(gate, up)``: SiTU-GLU (``"situ"``) or SwiGLU (``"silu"``).

    Holds ``hidden_act``, ``beta`` and ``linear_beta`` so a fused kernel can reproduce it.
    """

    def __init__(self, hidden_act: str = "situ", beta: float = 4.0, linear_beta: float = 25.0):
        super().__init__()
        if hidden_act not in ("situ", "silu"):
            raise ValueError(f"hidden_act must be 'situ' or 'silu', got {hidden_act!r}")
        self.hidden_act, self.beta, self.linear_beta = hidden_act, beta, linear_beta

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.hidden_act == "situ":
            return situ_glu(gate, up, self.beta, self.linear_beta)
        return F.silu(gate) * up

    def extra_repr(self) -> str:
        return f"{self.hidden_act}, beta={self.beta}, linear_beta={self.linear_beta}"


def moe_experts_torch(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    act_fn,
) -> torch.Tensor:
    """Weighted sum of the selected experts, one matmul pair per expert that received tokens.

    Args:
        hidden_states: ``[N, ℓ]`` token activations.
        top_k_index: ``[N, k]`` int expert ids; an id equal to ``E`` means "owned by another rank" and
            is skipped (expert-parallel convention of transformers).
        top_k_weights: ``[N, k]`` gate weights.
        gate_up_proj: ``[E, 2I, ℓ]`` — gate rows ``[:I]`` then up rows ``[I:]``.
        down_proj: ``[E, ℓ, I]``.
        act_fn: ``fn(gate, up)``, e.g. :class:`GLUActivation`.

    Returns:
        ``[N, ℓ]`` in ``hidden_states.dtype``: ``Σ_j w_j · down_j(act(gate_up_j x))``.
    """
    num_experts = gate_up_proj.shape[0]
    out = torch.zeros_like(hidden_states)
    flat_expert = top_k_index.flatten()
    order = flat_expert.argsort(stable=True)
    counts = torch.bincount(flat_expert, minlength=num_experts + 1)[:num_experts].tolist()
    token_of = order // top_k_index.shape[1]
    flat_weights = top_k_weights.flatten()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        slots = order[start : start + count]
        tokens = token_of[start : start + count]
        start += count
        gate, up = F.linear(hidden_states[tokens], gate_up_proj[expert]).chunk(2, dim=-1)
        y = F.linear(act_fn(gate, up), down_proj[expert])
        out.index_add_(0, tokens, (y * flat_weights[slots].unsqueeze(-1).to(y.dtype)).to(out.dtype))
    return out
