"""GLU activations evaluated in float32 inside the expert kernels, with their derivatives.

SiTU-GLU [Kimi K3 report §2.3]:  g(a, b) = [β1·tanh(a/β1)·σ(a)] ⊙ [β2·tanh(b/β2)], β1 = 4, β2 = 25
(``a`` = gate rows ``gate_up_proj[e, :I]``, ``b`` = up rows ``gate_up_proj[e, I:]``).
SwiGLU:                          g(a, b) = a·σ(a) ⊙ b.
"""

import triton
import triton.language as tl

ACT_SITU = 0
ACT_SILU = 1
ACTIVATIONS = {"situ": ACT_SITU, "silu": ACT_SILU}


@triton.jit
def glu_forward(a, b, ACT: tl.constexpr, beta1, beta2):
    """g(a, b) in float32 (a, b float32 tiles)."""
    # helpers are written inline: every nested jit call costs milliseconds under the CPU interpreter
    sa = 1.0 / (1.0 + tl.exp(-a))
    if ACT == 0:
        # tanh(x) = 2·σ(2x) − 1 (saturates cleanly: exp overflow gives 1/inf = 0)
        f1 = beta1 * (2.0 / (1.0 + tl.exp(-2.0 * a / beta1)) - 1.0) * sa
        f2 = beta2 * (2.0 / (1.0 + tl.exp(-2.0 * b / beta2)) - 1.0)
    else:
        f1 = a * sa
        f2 = b
    return f1 * f2


@triton.jit
def glu_backward(a, b, dg, ACT: tl.constexpr, beta1, beta2):
    """Returns (g, ∂L/∂a, ∂L/∂b) for upstream ∂L/∂g = dg (all float32 tiles)."""
    sa = 1.0 / (1.0 + tl.exp(-a))
    if ACT == 0:
        t1 = 2.0 / (1.0 + tl.exp(-2.0 * a / beta1)) - 1.0
        t2 = 2.0 / (1.0 + tl.exp(-2.0 * b / beta2)) - 1.0
        f1 = beta1 * t1 * sa
        df1 = (1.0 - t1 * t1) * sa + f1 * (1.0 - sa)
        f2 = beta2 * t2
        df2 = 1.0 - t2 * t2
    else:
        f1 = a * sa
        df1 = sa * (1.0 + a * (1.0 - sa))
        f2 = b
        df2 = tl.full(b.shape, 1.0, tl.float32)
    return f1 * f2, dg * df1 * f2, dg * f1 * df2
