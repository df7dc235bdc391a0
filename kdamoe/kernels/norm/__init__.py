"""RMSNorm, the KDA output's gated RMSNorm (sigmoid gate) and the residual add + RMSNorm, forward and backward in one
launch each: ``rms_norm``, ``gated_rms_norm`` and ``add_rms_norm``. See ``norm.py`` for the semantics and ``kernels.py``
for the kernels."""

from .norm import add_rms_norm, gated_rms_norm, rms_norm

__all__ = ["add_rms_norm", "gated_rms_norm", "rms_norm"]
