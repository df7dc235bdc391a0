"""Pure-PyTorch pieces of the Stable LatentMoE: the SiTU-GLU activation and the routed experts.

SiTU-GLU (Kimi K3 report §2.3; DESIGN.md §1.3)::

    SiTU-GLU(a, b) = [β1·tanh(a/β1) · σ(a)] ⊙ [β2·tanh(b/β2)]

Both branches are soft-capped, so ``|SiTU-GLU| < β1·β2``; near 0, ``β·tanh(x/β) ≈ x`` and it equals
SwiGLU ``a·σ(a) ⊙ b``.
"""

import torch
import torch.nn.functional as F
from torch import nn


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
