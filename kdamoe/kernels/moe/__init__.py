"""Stable LatentMoE kernels: Quantile-Balanced sigmoid routing and grouped-GEMM SiTU-GLU experts.

Public: :func:`moe_route` (Top-(k+1) routing, gate weights, token counts and QB histogram in one pass),
:func:`moe_experts` (grouped GEMMs with the GLU in the forward epilogue and a separate element-wise GLU backward,
weighted combine; forward and backward) and
:func:`glu` (the element-wise GLU of the dense MLP and the shared experts, forward and backward).
Sources: Kimi K3 report §2.3 (SiTU-GLU, Quantile Balancing); LatentMoE, arXiv:2601.18089; DeepSeek-V3
loss-free balancing, arXiv:2412.19437 (biased selection, unbiased gate weights).

Files: ``routing.py`` (routing op and kernel), ``experts.py`` (the experts op and autograd Function), its stages
``permute.py`` (token order by expert), ``grouped_gemm.py`` (the grouped GEMMs) and ``gemv.py`` (few-token decode
steps), ``glu.py`` (the element-wise GLU op and kernels), ``activation.py`` (SiTU / SiLU inside the kernels).

References: ``tests/moe_reference.py`` (float64 loops over tokens and experts), ``kdamoe.model.moe_torch``
(``moe_route_torch``, ``moe_experts_torch``) and ``kdamoe.model.quantile_balancing`` for the histograms
(``tests/kernels/test_moe_route.py``, ``test_moe_experts.py``, ``test_glu.py``).
"""

from .experts import moe_experts
from .glu import glu
from .routing import MoERouting, moe_route

__all__ = ["glu", "moe_experts", "moe_route", "MoERouting"]
