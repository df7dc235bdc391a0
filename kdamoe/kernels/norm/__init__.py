"""RMSNorm and the KDA output's gated RMSNorm (sigmoid gate), forward and backward in one launch each:
``rms_norm`` and ``gated_rms_norm``. See ``norm.py`` for the semantics and ``kernels.py`` for the kernels."""

from .norm import gated_rms_norm, rms_norm

__all__ = ["gated_rms_norm", "rms_norm"]
