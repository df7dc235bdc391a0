"""The causal-LM cross-entropy (transformers' ``ForCausalLMLoss`` semantics) on the logits as they are, one launch
forward and one backward: ``causal_lm_loss``. See ``cross_entropy.py`` for the semantics and ``kernels.py`` for the
kernels."""

from .cross_entropy import causal_lm_loss

__all__ = ["causal_lm_loss"]
