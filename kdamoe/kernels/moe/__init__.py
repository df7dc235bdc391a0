"""Stable LatentMoE kernels: Quantile-Balanced sigmoid routing and grouped-GEMM SiTU-GLU experts.

Public: :func:`moe_route` (Top-(k+1) routing, gate weights, token counts and QB histogram in one pass),
:func:`moe_experts` (grouped GEMMs with the GLU in the forward epilogue and a separate element-wise GLU backward,
weighted combine; forward and backward) and
:func:`glu` (the element-wise GLU of the dense MLP and the shared experts, forward and backward).
Sources: Kimi K3 report §2.3 (SiTU-GLU, Quantile Balancing); LatentMoE, arXiv:2601.18089; DeepSeek-V3
loss-free balancing, arXiv:2412.19437 (biased selection, unbiased gate weights).
"""

from .experts import moe_experts
from .glu import glu
from .routing import MoERouting, moe_route

__all__ = ["glu", "moe_experts", "moe_route", "MoERouting"]
