"""Triton kernels for kdamoe (optional fast path).

Imports only torch and triton (each op keeps its own argument checks), so the package works on an image with an
older transformers. Each kernel family is a sub-package: ``kda`` (chunked / recurrent Kimi Delta Attention), ``conv``
(the KDA layer's causal depthwise conv + SiLU), ``mla`` (flash-decoding of MLA attention in the latent space), ``moe``
(Quantile-Balanced routing, grouped-GEMM SiTU-GLU experts and the element-wise GLU of the dense MLP /
shared experts), ``norm`` (RMSNorm and the gated RMSNorm of the KDA output), ``attnres`` (the Block
Attention Residuals mix over depth) and ``loss`` (the causal-LM cross-entropy on the logits as they are).

One naming scheme in every family: the public op, its argument checks and its ``torch.autograd.Function`` in a file
named after the op (``chunk.py``, ``conv.py``, ``norm.py``, ...); the Triton kernels with their launchers in files
named by the pass or stage they run (``forward.py``, ``backward.py``, ``update.py``, or an algorithm's stages such
as KDA's ``prepare`` / ``intra`` / ``state`` / ``output``); a family's own reference in ``naive.py``. Each family's
``__init__`` names the reference its tests compare it with."""

from .attnres import block_attnres
from .conv import (
    causal_conv1d,
    causal_conv1d_parts,
    causal_conv1d_update,
    causal_conv1d_update_slots,
    causal_conv1d_varlen_slots,
)
from .kda import chunk_kda, fused_recurrent_kda, fused_recurrent_kda_slots
from .loss import causal_lm_loss
from .mla import SharedPrefixPlan, latent_attention, latent_attention_shared_prefix, write_rows_at
from .moe import glu, moe_experts, moe_route
from .norm import add_rms_norm, gated_rms_norm, rms_norm

__all__ = [
    "SharedPrefixPlan",
    "add_rms_norm",
    "block_attnres",
    "causal_conv1d",
    "causal_conv1d_parts",
    "causal_conv1d_update",
    "causal_conv1d_update_slots",
    "causal_conv1d_varlen_slots",
    "causal_lm_loss",
    "chunk_kda",
    "fused_recurrent_kda",
    "fused_recurrent_kda_slots",
    "gated_rms_norm",
    "glu",
    "latent_attention",
    "latent_attention_shared_prefix",
    "moe_experts",
    "moe_route",
    "rms_norm",
    "write_rows_at",
]
