"""The causal-LM cross-entropy (transformers' ``ForCausalLMLoss`` semantics) on the logits as they are, one launch
forward and one backward: ``causal_lm_loss``.

Files: ``cross_entropy.py`` (the public op, its checks and autograd Function), ``forward.py`` / ``backward.py`` (the
Triton kernels of each pass, with their launchers).

Reference: a float64 shift + ``log_softmax`` + NLL written in the test, and ``torch.nn.functional.cross_entropy``
(``tests/kernels/test_cross_entropy.py``)."""

from .cross_entropy import causal_lm_loss

__all__ = ["causal_lm_loss"]
