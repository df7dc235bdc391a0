"""Triton kernels for kdamoe (optional fast path).

Imports only torch and triton (and ``kdamoe.model.mla_torch`` / ``kdamoe.model.norm_torch`` /
``kdamoe.model.attnres_torch``, torch alone, for the shared argument checks), so the package works on an image with an
older transformers. Each kernel family is a sub-package: ``kda`` (chunked / recurrent Kimi Delta Attention), ``conv``
(the KDA layer's causal depthwise conv + SiLU), ``mla`` (flash-decoding of MLA attention in the latent space), ``moe``
(Quantile-Balanced routing, grouped-GEMM SiTU-GLU experts and the element-wise GLU of the dense MLP /
shared experts), ``norm`` (RMSNorm and the gated RMSNorm of the KDA output), ``attnres`` (the Block
Attention Residuals mix over depth) and ``loss`` (the causal-LM cross-entropy on the logits as they are)."""

from .attnres import block_attnres  # noqa: E402,F401
from .conv import causal_conv1d, causal_conv1d_parts, causal_conv1d_update  # noqa: E402,F401
from .kda import chunk_kda, fused_recurrent_kda  # noqa: E402,F401
from .loss import causal_lm_loss  # noqa: E402,F401
from .mla import latent_attention  # noqa: E402,F401
from .moe import glu, moe_experts, moe_route  # noqa: E402,F401
from .norm import add_rms_norm, gated_rms_norm, rms_norm  # noqa: E402,F401
