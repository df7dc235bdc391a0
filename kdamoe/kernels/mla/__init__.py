"""MLA attention in the latent space (absorbed up-projections, keys = values = the cached latent):
``latent_attention``, flash-decoding for decode steps and short continuations.

Files: ``decode.py`` (the public op, its checks, the split and combine kernels).

References: ``kdamoe.model.mla_torch.latent_attention_torch`` and a float64 brute-force softmax attention
(``tests/kernels/test_mla_decode.py``)."""

from .decode import latent_attention

__all__ = ["latent_attention"]
