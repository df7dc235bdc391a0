"""MLA attention in the latent space (absorbed up-projections, keys = values = the cached latent):
``latent_attention``, flash-decoding for decode steps and short continuations, and
``latent_attention_shared_prefix``, one decode query per sequence over a group's shared prefix rows (read once for
all its members) plus the sequence's own rows (the rollout engine's step), with ``SharedPrefixPlan``, its static
form (fixed-capacity device tables refilled per step: what a CUDA graph of the step captures), and ``write_rows_at``,
which appends the step's new rows to the addresses in a device table.

Files: ``decode.py`` (the public op, its checks, the split and combine kernels), ``shared_prefix.py`` (the same for
the shared-prefix decode, and its plan), ``write_rows.py`` (rows to addresses) and ``naive.py``
(the shared-prefix reference).

References: ``kdamoe.model.mla_torch.latent_attention_torch`` and a float64 brute-force softmax attention
(``tests/kernels/test_mla_decode.py``); ``naive.py``'s ``naive_latent_attention_shared_prefix`` in float64
(``tests/kernels/test_mla_shared_prefix.py``)."""

from .decode import latent_attention
from .shared_prefix import SharedPrefixPlan, latent_attention_shared_prefix
from .write_rows import write_rows_at

__all__ = ["SharedPrefixPlan", "latent_attention", "latent_attention_shared_prefix", "write_rows_at"]
