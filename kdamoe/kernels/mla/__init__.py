"""MLA attention in the latent space (absorbed up-projections, keys = values = the cached latent):
``latent_attention``, flash-decoding for decode steps and short continuations, and
``latent_attention_shared_prefix``, one decode query per sequence over a group's shared prefix rows (read once for
all its members) plus the sequence's own rows (the rollout engine's step).

Files: ``decode.py`` (the public op, its checks, the split and combine kernels), ``shared_prefix.py`` (the same for
the shared-prefix decode) and ``naive.py`` (the shared-prefix reference).

References: ``kdamoe.model.mla_torch.latent_attention_torch`` and a float64 brute-force softmax attention
(``tests/kernels/test_mla_decode.py``); ``naive.py``'s ``naive_latent_attention_shared_prefix`` in float64
(``tests/kernels/test_mla_shared_prefix.py``)."""

from .decode import latent_attention
from .shared_prefix import latent_attention_shared_prefix

__all__ = ["latent_attention", "latent_attention_shared_prefix"]
