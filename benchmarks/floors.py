"""FLOP and byte floors of every kernel family, at the e2e benchmark's shape and at K3's (issue #40, Deliver 1).

For each kernel (one call, i.e. one layer, at T tokens) this counts the floating-point operations the math needs and
the fewest bytes that must cross device memory (each input read once, each output written once, nothing else), turns
them into a time floor on the H200 and the H100 (``max(FLOP / matrix rate, bytes / copy bandwidth)``), and sets the
last measured time beside it (the 32K profile of ``benchmarks/results/e2e_h200.json``, per call = µs per step / calls
per step). ``docs/kernels.md`` § "Floors" derives every formula below and shows this script's table.

Conventions (the docs say why):

* A FLOP is one multiply or one add: an ``[m, k] @ [k, n]`` product is ``2·m·k·n``.
* Causal products (attention, the chunk-local KDA matrices) count the lower triangle only, half the dense product.
* Element-wise work (SiLU, sigmoid, exp, the norm's reductions) is left out of the FLOPs: at most tens of FLOPs per
  element, far under the byte time of the same kernels.
* Bytes: bfloat16 activations, weights and gradients (2 bytes), float32 where the model's op keeps float32 (the
  router logits and their gradient). Weights count once per call. KDA stages count the tensors of the chunked
  algorithm's interfaces (q, k, v, g, w, u, kg, qg, v_new, A_qk, the per-chunk states h) at 2 bytes each, not the
  float32 scratch our kernels happen to keep: the floor of a stage split where ours is split.

Shapes: ``OURS`` is ``harness.Shape`` (the 1.68 B model of ``bench_e2e.py``: hidden 1,024, 12 KDA layers of 8 × 128,
4 MLA layers of 8 heads × 128, 15 MoE layers of 64 experts top-8, width 512, no latent). ``K3`` is the issue's K3
shape: KDA 96 × 128; 896 experts top-16 in a 3,584-wide latent, expert width 3,072, one expert-parallel rank's 112
experts. The issue fixes no K3 hidden size, vocabulary or MLA shape; those follow ``memory_per_rank.py``'s
assumption (Kimi K2's published hidden size 7,168 and vocabulary 163,840; 64 MLA heads of 128), marked "assumed".
With balanced routing and ``E / E_local`` = 8 ranks each holding T tokens, one rank's experts receive ``T·k`` rows
(``T·k·E_local/E`` from each of the 8 ranks).

Sources of the math: the chunked KDA stages follow ``kdamoe/kernels/kda/chunk.py`` (Kimi Linear report §3, the WY
representation of Yang et al.'s gated delta rule); the attention backward is FlashAttention's (Dao et al.: QKᵀ
recomputed, five products); a unit-triangular inverse of order C costs C³/3 FLOP (Golub & Van Loan, §3.1).

Rates: ``DEVICES`` — matrix rate and copy bandwidth measured in this workplace (the device notes), float32 SIMT rate
from the vendor's datasheet (no measurement here).

Usage::

    python benchmarks/floors.py                   # markdown table on stdout (the docs' table)
    python benchmarks/floors.py --tokens 8192     # the same at another T (measured column only at 32K)
    python benchmarks/floors.py --json out.json   # every row's numbers
"""

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, replace

BF16 = 2  # bytes per element
FP32 = 4
PROFILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "e2e_h200.json")
PROFILE_KEY = "kdamoe_T32768"  # the profile the measured column reads; its T
PROFILE_T = 32768


@dataclass(frozen=True)
class Device:
    """One GPU's ceilings: ``mm_tflops`` bf16 tensor-core GEMM rate (TFLOP/s), ``fp32_tflops`` plain float32 (SIMT)
    rate (TFLOP/s), ``copy_tbs`` device-to-device copy bandwidth counting bytes read plus written (TB/s)."""

    name: str
    mm_tflops: float
    fp32_tflops: float
    copy_tbs: float


# Measured in this workplace: an 8192³ bf16 matmul on random data and a large device-to-device copy through PyTorch
# (H200: 788 TFLOP/s and 4.3 TB/s, one-GPU machine, 2026-10-28; H100: 798 TFLOP/s and 3.0 TB/s, 2026-11-13).
# float32 without tensor cores: the datasheet's 67 TFLOP/s for both SXM parts (never measured here).
DEVICES = (Device("H200", 788.0, 67.0, 4.3), Device("H100", 798.0, 67.0, 3.0))


@dataclass(frozen=True)
class ModelShape:
    """The dimensions the floors need. ``tokens`` T per call; ``hidden`` d; KDA ``kda_heads`` × ``kda_dim`` (K = V),
    ``chunk`` C, ``conv_width`` W; MLA ``mla_heads`` × ``mla_dim`` (q·k and v head dim), ``kv_rank`` the latent's
    width; experts ``experts`` E of which ``local_experts`` on this rank, ``top_k`` k, ``latent`` ℓ (the width the
    experts read and write; d when there is no latent), ``inter`` I; ``vocab`` V of the loss."""

    name: str
    tokens: int
    hidden: int
    kda_heads: int
    kda_dim: int
    mla_heads: int
    mla_dim: int
    kv_rank: int
    experts: int
    local_experts: int
    top_k: int
    latent: int
    inter: int
    vocab: int
    chunk: int = 64
    conv_width: int = 4

    def __post_init__(self):
        _check(**{k: v for k, v in asdict(self).items() if k != "name"})
        if self.local_experts > self.experts:
            raise ValueError(f"local_experts {self.local_experts} exceeds experts {self.experts}")

    @property
    def routed_rows(self) -> int:
        """Rows through this rank's experts: T·k (balanced routing; see the module docstring)."""
        return self.tokens * self.top_k


def _check(**dims):
    for name, value in dims.items():
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


OURS = ModelShape("ours", tokens=32768, hidden=1024, kda_heads=8, kda_dim=128, mla_heads=8, mla_dim=128, kv_rank=256,
                  experts=64, local_experts=64, top_k=8, latent=1024, inter=512, vocab=32000)
K3 = ModelShape("K3", tokens=32768, hidden=7168, kda_heads=96, kda_dim=128, mla_heads=64, mla_dim=128, kv_rank=512,
                experts=896, local_experts=112, top_k=16, latent=3584, inter=3072, vocab=163840)


# ------------------------------------------------------------------------------------------------ the formulas
# Each returns (FLOP, bytes) for one call. Derivations: docs/kernels.md, "Floors".


def gemm(m: int, k: int, n: int, a_bytes: int = BF16, b_bytes: int = BF16, c_bytes: int = BF16) -> tuple[int, int]:
    """``[m, k] @ [k, n]``: ``2·m·k·n`` FLOP; A, B read and C written once. Raises ValueError on a non-positive dim."""
    _check(m=m, k=k, n=n)
    return 2 * m * k * n, m * k * a_bytes + k * n * b_bytes + m * n * c_bytes


def conv_fwd(T: int, C: int, W: int) -> tuple[int, int]:
    """Depthwise causal conv + SiLU over ``[T, C]``: ``2·W·T·C`` FLOP; x read, y written (bf16)."""
    _check(T=T, C=C, W=W)
    return 2 * W * T * C, 2 * T * C * BF16


def conv_bwd(T: int, C: int, W: int) -> tuple[int, int]:
    """Its backward: ``6·W·T·C`` FLOP (the pre-activation recomputed from x for SiLU', then dx and dweight, each
    ``2·W·T·C``); x and dy read, dx written (the forward saves x only)."""
    _check(T=T, C=C, W=W)
    return 6 * W * T * C, 3 * T * C * BF16


def rms_norm_fwd(rows: int, D: int) -> tuple[int, int]:
    """RMSNorm of ``[rows, D]``: x read, y written."""
    _check(rows=rows, D=D)
    return 0, 2 * rows * D * BF16


def rms_norm_bwd(rows: int, D: int) -> tuple[int, int]:
    """Its backward: x and dy read, dx written (dweight: per-program partials, ``D`` floats each, left out)."""
    _check(rows=rows, D=D)
    return 0, 3 * rows * D * BF16


def add_rms_norm_fwd(rows: int, D: int) -> tuple[int, int]:
    """``h = x + r``, ``y = RMSNorm(h)``: x and r read, h and y written."""
    _check(rows=rows, D=D)
    return 0, 4 * rows * D * BF16


def add_rms_norm_bwd(rows: int, D: int) -> tuple[int, int]:
    """Its backward: h, dy and dh (the residual stream's gradient) read, one gradient written (dx = dr)."""
    _check(rows=rows, D=D)
    return 0, 4 * rows * D * BF16


def gated_rms_norm_fwd(rows: int, D: int) -> tuple[int, int]:
    """``RMSNorm(x) · σ(gate)``: x and gate read, y written."""
    _check(rows=rows, D=D)
    return 0, 3 * rows * D * BF16


def gated_rms_norm_bwd(rows: int, D: int) -> tuple[int, int]:
    """Its backward: x, gate and dy read, dx and dgate written."""
    _check(rows=rows, D=D)
    return 0, 5 * rows * D * BF16


def cross_entropy_fwd(T: int, vocab: int) -> tuple[int, int]:
    """Row-wise cross-entropy on bf16 logits ``[T, V]``: the logits read once (per-row stats: 3 floats, left out)."""
    _check(T=T, vocab=vocab)
    return 0, T * vocab * BF16


def cross_entropy_bwd(T: int, vocab: int) -> tuple[int, int]:
    """Its backward: the logits read, their gradient written."""
    _check(T=T, vocab=vocab)
    return 0, 2 * T * vocab * BF16


def router_gemms(T: int, d: int, E: int) -> tuple[int, int]:
    """The router linear forward and its two backward GEMMs: ``3 · 2·T·d·E`` FLOP; bf16 x read three times in all
    (forward, ∂W, and ∂x written once), float32 logits / their gradient ``[T, E]`` written once and read twice."""
    _check(T=T, d=d, E=E)
    return 3 * 2 * T * d * E, 3 * T * d * BF16 + 3 * T * E * FP32


def route_topk(T: int, E: int, k: int) -> tuple[int, int]:
    """Sigmoid + top-k on float32 logits ``[T, E]``: logits read, k int32 indices and k float32 weights written."""
    _check(T=T, E=E, k=k)
    return 0, T * E * FP32 + T * k * (4 + FP32)


def experts_gemms(s: ModelShape) -> dict[str, tuple[int, int]]:
    """The six routed-expert GEMMs of one MoE layer on ``M = s.routed_rows`` rows, ℓ = latent, I = inter, with
    ``s.local_experts`` experts' weights (W1 ``[E, ℓ, 2I]``, W2 ``[E, I, ℓ]``). The token operand of gate/up is the
    ``T`` tokens (read once, gathered k times through cache), its output the GLU'd ``[M, I]``."""
    M, ell, inter, E = s.routed_rows, s.latent, s.inter, s.local_experts
    w1, w2 = E * ell * 2 * inter * BF16, E * inter * ell * BF16
    return {
        "gate/up fwd": (2 * M * ell * 2 * inter, s.tokens * ell * BF16 + w1 + M * inter * BF16),
        "down fwd": (2 * M * inter * ell, M * inter * BF16 + w2 + M * ell * BF16),
        "∂g′ = ∂y·W2ᵀ": (2 * M * ell * inter, M * ell * BF16 + w2 + M * inter * BF16),
        "∂x = ∂(g,u)·W1ᵀ": (2 * M * 2 * inter * ell, M * 2 * inter * BF16 + w1 + M * ell * BF16),
        "∂W1 = xᵀ·∂(g,u)": (2 * M * ell * 2 * inter, s.tokens * ell * BF16 + M * 2 * inter * BF16 + w1),
        "∂W2 = hᵀ·∂y": (2 * M * inter * ell, M * inter * BF16 + M * ell * BF16 + w2),
    }


def glu_rows_bwd(M: int, inter: int) -> tuple[int, int]:
    """The GLU derivative per routed row: ∂g′ ``[M, I]`` and the saved gate/up ``[M, 2I]`` read, ∂(g, u) written."""
    _check(M=M, inter=inter)
    return 0, (inter + 2 * inter + 2 * inter) * M * BF16


def combine(T: int, k: int, ell: int) -> tuple[int, int]:
    """Sum of the k slots per token: ``[T·k, ℓ]`` read, ``[T, ℓ]`` written (k − 1 adds per output element)."""
    _check(T=T, k=k, ell=ell)
    return (k - 1) * T * ell, (k + 1) * T * ell * BF16


def kda_stages(T: int, H: int, D: int, C: int) -> dict[str, tuple[int, int]]:
    """Chunked KDA (K = V = D, chunk C) per stage, all H heads of one layer; triangles at half (see the docs).

    Forward: ``intra`` (A_kk, A_qk, the unit-triangular inverse, w, u, kg, qg), ``state`` (the sequential pass:
    v_new = u − w·S, S ← diag(γ)·S + kgᵀ·v_new), ``output`` (o = qg·S + A_qk·v_new). Backward: ``dv_local`` (A_qkᵀ·do),
    ``state bwd`` (dS ← diag(γ)·dS + qgᵀ·do − wᵀ·dv_new, dv_new = dv_local + kg·dS), ``wy bwd`` (do·Sᵀ, v_new·dSᵀ,
    dv_new·Sᵀ, the A and inverse gradients, dv), ``intra bwd`` (dA_qk, dA_kk back to dq, dk, dg, dβ).
    """
    _check(T=T, H=H, D=D, C=C)
    n, hs = T * H, T * H * D * D // C  # token-heads; elements of the per-chunk states h (or dh)
    e = BF16
    return {
        "intra fwd": ((2 * C * D + C * C // 3 + 2 * C * D) * n, ((4 * D + 1) + (4 * D + C)) * n * e),
        "state fwd": (4 * D * D * n, 3 * D * n * e + (D * n + hs) * e),
        "output fwd": ((2 * D * D + C * D) * n, (2 * D + C) * n * e + hs * e + D * n * e),
        "dv_local": (C * D * n, (C + D) * n * e + D * n * e),
        "state bwd": (6 * D * D * n, 5 * D * n * e + (hs + D * n) * e),
        "wy bwd": ((6 * D * D + 4 * C * D) * n, ((7 * D + 1 + C) * n + 2 * hs) * e + (2 * C + 4 * D) * n * e),
        "intra bwd": (4 * C * D * n, ((6 * D + 1) + 2 * C) * n * e + (3 * D + 1) * n * e),
    }


def kda_fused(T: int, H: int, D: int) -> dict[str, tuple[None, int]]:
    """The bytes no split of KDA can go below: forward reads q, k, v, g, β and writes o; backward reads those and do
    and writes dq, dk, dv, dg, dβ (states recomputed, never stored)."""
    _check(T=T, H=H, D=D)
    n = T * H
    return {"forward, fused": (None, (5 * D + 1) * n * BF16), "backward, fused": (None, (9 * D + 2) * n * BF16)}


def sdpa(T: int, heads: int, dim: int) -> dict[str, tuple[int, int]]:
    """Causal attention, q·k and v head dim ``dim``: forward ``2 · 2·T²·dim·heads / 2`` (two products, half the
    square), backward five products of the same size; q, k, v, o (and do, dq, dk, dv) read or written once."""
    _check(T=T, heads=heads, dim=dim)
    fwd = 2 * T * T * dim * heads
    elems = T * heads * dim
    return {"SDPA fwd": (fwd, 4 * elems * BF16), "SDPA bwd": (5 * fwd // 2, 8 * elems * BF16)}


# ------------------------------------------------------------------------------------------------ the table


@dataclass
class Row:
    """One kernel at one shape: ``calls`` per training step, ``flop`` / ``bytes`` per call (``flop`` None where the
    kernel is byte-bound by construction), ``fp32`` when its FLOPs run on the plain float32 units, ``kernels`` the
    profile names whose time the measured column sums (per call of this row)."""

    shape: str
    family: str
    op: str
    calls: int
    flop: int | None
    bytes: int
    fp32: bool = False
    kernels: tuple = ()
    kernel_calls: int = 0  # profile calls that make up ``calls`` calls of this row (0: the row's own ``calls``)
    note: str = ""


def floor_us(row: Row, dev: Device) -> tuple[float, str]:
    """``(µs, bound)``: the larger of FLOP / rate and bytes / bandwidth, and which one it is ("FLOP" or "bytes")."""
    t_bytes = row.bytes / (dev.copy_tbs * 1e12) * 1e6
    if not row.flop:
        return t_bytes, "bytes"
    rate = dev.fp32_tflops if row.fp32 else dev.mm_tflops
    t_flop = row.flop / (rate * 1e12) * 1e6
    return (t_flop, "FLOP") if t_flop >= t_bytes else (t_bytes, "bytes")


def rows_for(s: ModelShape) -> list[Row]:
    """Every kernel of one training step at shape ``s`` (layer counts of ``harness.Shape``: 12 KDA, 4 MLA, 15 MoE)."""
    T, kda, mla, moe = s.tokens, 12, 4, 15
    HD = s.kda_heads * s.kda_dim
    C3 = 3 * HD
    r = [
        Row(s.name, "short conv", "conv fwd (q, k, v as one)", kda, *conv_fwd(T, C3, s.conv_width),
            kernels=("_conv_fwd_kernel",)),
        Row(s.name, "short conv", "conv bwd (q, k, v as one)", kda, *conv_bwd(T, C3, s.conv_width),
            kernels=("_conv_bwd_dpre_kernel", "_conv_bwd_dx_kernel")),
    ]
    # 16 input norms (plain: the MoE output is added outside), 16 add+norms, the final norm, 4 MLA latent norms,
    # 12 KDA output norms, the loss: 49 norm calls + 1 loss share the kernel names `_forward_kernel` /
    # `_backward_kernel` in the profile, so their measured time is one group.
    fwd = [rms_norm_fwd(T, s.hidden)] * 17 + [rms_norm_fwd(T, s.kv_rank)] * 4 + [add_rms_norm_fwd(T, s.hidden)] * 16 \
        + [gated_rms_norm_fwd(T * s.kda_heads, s.kda_dim)] * 12 + [cross_entropy_fwd(T, s.vocab)]
    bwd = [rms_norm_bwd(T, s.hidden)] * 17 + [rms_norm_bwd(T, s.kv_rank)] * 4 + [add_rms_norm_bwd(T, s.hidden)] * 16 \
        + [gated_rms_norm_bwd(T * s.kda_heads, s.kda_dim)] * 12 + [cross_entropy_bwd(T, s.vocab)]
    assumed = "hidden assumed" if s.name == K3.name else ""
    vocab_note = "vocab assumed" if s.name == K3.name else ""
    r += [
        Row(s.name, "norms", "RMSNorm fwd, d", 1, *rms_norm_fwd(T, s.hidden), note=assumed),
        Row(s.name, "norms", "RMSNorm bwd, d", 1, *rms_norm_bwd(T, s.hidden), note=assumed),
        Row(s.name, "norms", "add+RMSNorm fwd, d", 1, *add_rms_norm_fwd(T, s.hidden), note=assumed),
        Row(s.name, "norms", "add+RMSNorm bwd, d", 1, *add_rms_norm_bwd(T, s.hidden), note=assumed),
        Row(s.name, "norms", "gated RMSNorm fwd (KDA out)", 1, *gated_rms_norm_fwd(T * s.kda_heads, s.kda_dim)),
        Row(s.name, "norms", "gated RMSNorm bwd (KDA out)", 1, *gated_rms_norm_bwd(T * s.kda_heads, s.kda_dim)),
        Row(s.name, "loss", "cross-entropy fwd", 1, *cross_entropy_fwd(T, s.vocab), note=vocab_note),
        Row(s.name, "loss", "cross-entropy bwd", 1, *cross_entropy_bwd(T, s.vocab), note=vocab_note),
    ]
    if s.name == OURS.name:  # per step, with our layer layout (the profile cannot tell these kernels apart)
        r += [
            Row(s.name, "norms", "49 norms, fwd (per step)", 1, None, sum(b for _, b in fwd[:-1])),
            Row(s.name, "norms", "49 norms, bwd (per step)", 1, None, sum(b for _, b in bwd[:-1])),
            Row(s.name, "norms", "49 norms + loss, fwd (per step)", 1, None, sum(b for _, b in fwd),
                kernels=("_forward_kernel",), kernel_calls=50),
            Row(s.name, "norms", "49 norms + loss, bwd (per step)", 1, None, sum(b for _, b in bwd),
                kernels=("_backward_kernel",), kernel_calls=50),
        ]
    r += [
        Row(s.name, "router", "router GEMMs fwd + ∂x + ∂W, float32", moe, *router_gemms(T, s.hidden, s.experts),
            fp32=True, kernels=("sm80_xmma_gemm_f32f32", "cutlass_80_simt_sgemm"), kernel_calls=3 * moe,
            note=assumed),
        Row(s.name, "router", "router GEMMs fwd + ∂x + ∂W, bf16 tensor cores", moe,
            *router_gemms(T, s.hidden, s.experts), note="; ".join(x for x in ("a replacement's floor", assumed) if x)),
        Row(s.name, "router", "sigmoid + top-k", moe, *route_topk(T, s.experts, s.top_k), kernels=("_route_kernel",)),
    ]
    ex = experts_gemms(s)
    for op, (f, b) in ex.items():
        r.append(Row(s.name, "experts", op, moe, f, b, kernels=("_gate_up_fwd_kernel",) if op == "gate/up fwd" else ()))
    rows3 = [ex["down fwd"], ex["∂g′ = ∂y·W2ᵀ"], ex["∂x = ∂(g,u)·W1ᵀ"]]
    wg = [ex["∂W1 = xᵀ·∂(g,u)"], ex["∂W2 = hᵀ·∂y"]]
    r += [
        Row(s.name, "experts", "row GEMMs: down + ∂g′ + ∂x", moe, sum(f for f, _ in rows3), sum(b for _, b in rows3),
            kernels=("_rows_gemm_kernel",), kernel_calls=3 * moe),
        Row(s.name, "experts", "weight grads: ∂W1 + ∂W2", moe, sum(f for f, _ in wg), sum(b for _, b in wg),
            kernels=("_wgrad_kernel",), kernel_calls=2 * moe),
        Row(s.name, "experts", "GLU derivative per row", moe, *glu_rows_bwd(s.routed_rows, s.inter),
            kernels=("_glu_rows_bwd_kernel",)),
        Row(s.name, "experts", "combine k slots (fwd, bwd)", 2 * moe, *combine(T, s.top_k, s.latent),
            kernels=("_combine_kernel",)),
    ]
    names = {"intra fwd": "_intra_fwd_kernel", "state fwd": "_state_fwd_kernel", "output fwd": "_output_fwd_kernel",
             "dv_local": "_dv_local_kernel", "state bwd": "_state_bwd_kernel", "wy bwd": "_bwd_wy_kernel",
             "intra bwd": "_bwd_intra_kernel"}
    for op, (f, b) in kda_stages(T, s.kda_heads, s.kda_dim, s.chunk).items():
        r.append(Row(s.name, "KDA", op, kda, f, b, kernels=(names[op],)))
    st = kda_stages(T, s.kda_heads, s.kda_dim, s.chunk)
    fused = kda_fused(T, s.kda_heads, s.kda_dim)
    fwd_f = sum(st[k][0] for k in ("intra fwd", "state fwd", "output fwd"))
    bwd_f = sum(st[k][0] for k in ("dv_local", "state bwd", "wy bwd", "intra bwd"))
    r += [
        Row(s.name, "KDA", "forward, fused", kda, fwd_f, fused["forward, fused"][1],
            kernels=("_intra_fwd_kernel", "_state_fwd_kernel", "_output_fwd_kernel")),
        Row(s.name, "KDA", "backward, fused", kda, bwd_f, fused["backward, fused"][1],
            kernels=("_dv_local_kernel", "_state_bwd_kernel", "_bwd_wy_kernel", "_bwd_intra_kernel")),
    ]
    mla_note = "MLA shape assumed" if s.name == K3.name else ""
    for op, (f, b) in sdpa(T, s.mla_heads, s.mla_dim).items():
        prefix = "cudnn_generated_fort_native_sdpa_sm90_flash_" + ("fprop" if "fwd" in op else "bprop")
        r.append(Row(s.name, "MLA", op, mla, f, b, kernels=(prefix,), note=mla_note))
    return r


def load_profile(path: str = PROFILE, key: str = PROFILE_KEY) -> list[dict]:
    """The kernel table (``name``, ``calls``, ``us`` per step) of one e2e profile; ValueError if it is missing."""
    with open(path) as f:
        doc = json.load(f)
    try:
        return doc["raw"]["profile"][key]["table"]
    except KeyError as e:
        raise ValueError(f"{path} has no profile {key!r}") from e


def measured_us(row: Row, table: list[dict]) -> float | None:
    """µs per call of ``row``: the profile's µs per step over every kernel whose name starts with (or, for the cuBLAS
    names, contains) one of ``row.kernels``, divided by the row's calls; None when no kernel matched or the calls
    per step differ from what the row expects."""
    if not row.kernels:
        return None
    hits = [e for e in table if any(e["name"].startswith(k) or (k in e["name"] and not k.startswith("_"))
                                    for k in row.kernels)]
    if not hits:
        return None
    expect = row.kernel_calls or row.calls * len(row.kernels)
    if round(sum(e["calls"] for e in hits)) != expect:
        return None
    return sum(e["us"] for e in hits) / row.calls


def table(shapes=(OURS, K3), profile: list[dict] | None = None) -> list[dict]:
    """One dict per row: shape, family, op, calls, GFLOP, MB, the floor on each device (µs, bound), measured µs per
    call (the H200 profile; ``OURS`` at 32K only) and measured / H200 floor."""
    out = []
    for s in shapes:
        for row in rows_for(s):
            d = {k: v for k, v in asdict(row).items() if k not in ("kernels", "kernel_calls", "flop", "bytes")}
            d["gflop"] = None if row.flop is None else row.flop / 1e9
            d["mb"] = row.bytes / 1e6
            for dev in DEVICES:
                us, bound = floor_us(row, dev)
                d[f"{dev.name}_floor_us"], d[f"{dev.name}_bound"] = us, bound
            m = measured_us(row, profile) if profile is not None and s.name == "ours" and s.tokens == PROFILE_T \
                else None
            d["measured_us"] = m
            d["ratio"] = None if m is None else m / d["H200_floor_us"]
            out.append(d)
    return out


def _g(x, digits=3):
    if x is None:
        return "—"
    return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:,.0f}"


def markdown(rows: list[dict]) -> str:
    """The docs' table."""
    lines = ["| shape | family | kernel | calls/step | GFLOP | MB | H200 floor µs | H100 floor µs | measured µs "
             "(H200) | measured / floor | note |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for d in rows:
        calls = d["calls"] if d["shape"] == OURS.name else "—"  # K3's layer count is not ours
        lines.append(f"| {d['shape']} | {d['family']} | {d['op']}{' (fp32 SIMT)' if d['fp32'] else ''} | {calls} "
                     f"| {_g(d['gflop'])} | {_g(d['mb'])} | {_g(d['H200_floor_us'])} ({d['H200_bound']}) "
                     f"| {_g(d['H100_floor_us'])} ({d['H100_bound']}) | {_g(d['measured_us'])} | {_g(d['ratio'])} "
                     f"| {d['note']} |")
    return "\n".join(lines)


def step_total(rows: list[dict]) -> tuple[float, float, float]:
    """``(floor µs, measured µs, H100 floor µs)`` per step over the rows that have a measured time, the fused KDA
    rows left out (their stages are rows of their own), each row's per-call numbers times its calls."""
    picked = [d for d in rows if d["measured_us"] is not None and "fused" not in d["op"]]
    return (sum(d["H200_floor_us"] * d["calls"] for d in picked), sum(d["measured_us"] * d["calls"] for d in picked),
            sum(d["H100_floor_us"] * d["calls"] for d in picked))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=32768, help="T per call for both shapes (default 32768)")
    p.add_argument("--profile", default=PROFILE, help="e2e results JSON whose 32K profile gives the measured column")
    p.add_argument("--json", default=None, help="also write every row's numbers to this file")
    a = p.parse_args(argv)
    if a.tokens <= 0:
        raise ValueError(f"--tokens must be positive, got {a.tokens}")
    shapes = (replace(OURS, tokens=a.tokens), replace(K3, tokens=a.tokens))
    rows = table(shapes, load_profile(a.profile) if os.path.isfile(a.profile) else None)
    print(markdown(rows))
    floor, measured, floor_h100 = step_total(rows)
    if measured:
        print(f"\nPer step, over the rows with a measured time: floor {floor / 1e3:.1f} ms on the H200 "
              f"({floor_h100 / 1e3:.1f} on the H100), measured {measured / 1e3:.1f} ms on the H200 "
              f"({measured / floor:.2f}× the floor).")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
