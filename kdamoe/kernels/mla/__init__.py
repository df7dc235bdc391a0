"""MLA attention in the latent space (absorbed up-projections, keys = values = the cached latent):
``latent_attention``, flash-decoding for decode steps and short continuations. See ``decode.py``."""

from .decode import latent_attention

__all__ = ["latent_attention"]
