"""Triton kernels of the softmax cross-entropy over vocabulary rows: one launch forward, one launch backward.

One program per row ``n`` of ``logits [N, V]`` (float16 / bfloat16 / float32, unit last stride, row stride
``stride_x``), with the row's target ``t_n`` (int32 / int64). All arithmetic is float32; the logits are read in their
own dtype, never copied. With ``x = float32(logits[n])``::

    forward   m_n = max_v x_v,  r_n = log Σ_v exp(x_v − m_n)      (online, block by block; lse_n = m_n + r_n)
              loss_n = (m_n − x_{t_n}) + r_n                        (= −log softmax(x)_{t_n})
    backward  dx_v   = (exp((x_v − m_n) − r_n) − [v = t_n]) · g_n   (∂loss_n/∂x_v = softmax(x)_v − onehot(t_n)_v)

The log-sum-exp is kept as its two parts ``(m_n, r_n)`` rather than ``lse_n``: at logits of magnitude L, float32
``lse_n`` carries an absolute error of about L · 2⁻²⁴, which ``x − lse`` turns into a relative error of every softmax
value (8e-5 at L = 10⁴), while ``x − m`` is exact near the max (Sterbenz) and ``r_n`` is small — the same order of
operations as PyTorch's ``log_softmax`` (``x − max``, then ``− log Σ``), so the two agree to float32 rounding.

``g_n`` is the incoming gradient of ``loss_n`` (the reduction's ``1 / denominator`` times the upstream gradient).
Rows whose target equals ``ignore_index`` read nothing (their loads are masked off, so no memory traffic) and get
``loss = 0``, ``m = r = 0`` and a zero gradient row. A target outside ``[0, V)`` that is not ``ignore_index`` cannot be
reported from a kernel without a host sync: it is never used as an address, and its row gets a NaN loss and a NaN
gradient, so the error shows instead of a silent wrong value (the model checks the labels in its input sync first).

Traffic: the forward reads each active row once; the backward reads it once more and writes the gradient once, in
the logits' dtype — three passes over the logits in all. ``BLOCK_V`` columns per step (at most 4096 with 8 warps:
16 contiguous elements per thread, 32 bytes of bf16) keep the registers bounded for any V, so a 32K-token row
batch of V = 32000 runs 32K programs of 8 steps. Nothing is read back on the host (CUDA-graph capturable).
"""

import torch
import triton
import triton.language as tl

from ..launch import fast_launch
from ..utils import next_power_of_2

MAX_BLOCK_V = 4096  # columns per loop step; larger rows loop, smaller ones use next_pow2(V)


@fast_launch
@triton.jit
def _forward_kernel(X, TARGET, LOSS, ROW_MAX, LOG_SUM, V, stride_x, ignore_index, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    target = tl.load(TARGET + row)
    active = target != ignore_index  # an ignored row reads no logits: its loads are masked off
    x_row = X + row.to(tl.int64) * stride_x  # int64: N · V passes 2^31 from 67K tokens at V = 32000
    cols = tl.arange(0, BLOCK_V)
    # The first block is peeled so that the running max starts from real values (no −inf − (−inf) on entry).
    x = tl.load(x_row + cols, mask=(cols < V) & active, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    # A block of −inf only (masked-off lanes, an ignored row, or a vocabulary masked with −inf) must add 0 to the
    # sum, not exp(−inf − (−inf)) = NaN: shift by 0 instead while the max is still −inf.
    shift = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(tl.exp(x - shift), axis=0)
    for start in range(BLOCK_V, V, BLOCK_V):
        offs = start + cols
        x = tl.load(x_row + offs, mask=(offs < V) & active, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)  # rescale the old sum to the new max
        m = m_new
    r = tl.log(tl.where(active, s, 1.0))  # an ignored row's s is 0: no log(0) (the interpreter warns on it)
    in_range = (target >= 0) & (target < V)
    # The target's logit: one scalar load from the row just read (in L2); an out-of-range target is never an address.
    x_t = tl.load(x_row + tl.where(in_range, target, 0), mask=active & in_range, other=0.0).to(tl.float32)
    loss = tl.where(in_range, (m - x_t) + r, float("nan"))
    tl.store(LOSS + row, tl.where(active, loss, 0.0))
    # 0, not −inf, on an ignored row, so that the backward's exp(−inf − m − r) stays 0
    tl.store(ROW_MAX + row, tl.where(active, m, 0.0))
    tl.store(LOG_SUM + row, tl.where(active, r, 0.0))


def _launch_config(V: int) -> tuple[int, int]:
    """``(BLOCK_V, num_warps)``: next_pow2(V) up to :data:`MAX_BLOCK_V` columns per step, one warp per 512 columns
    (16 elements per thread at the maximum), at least one. Fixed, not autotuned: a launch costs no timing runs, and
    the rows are long enough that the loop, not the tile shape, decides the bandwidth."""
    block = min(MAX_BLOCK_V, next_power_of_2(V))
    return block, max(1, min(8, block // 512))


def cross_entropy_forward(logits: torch.Tensor, target: torch.Tensor, ignore_index: int):
    """``(loss, row_max, log_sum)``, each ``[N]`` float32 (``lse = row_max + log_sum``; zeros on ignored rows), of
    ``logits [N, V]`` (unit last stride) and ``target [N]`` (contiguous int32 / int64); arguments already checked by
    the caller."""
    N, V = logits.shape
    loss, row_max, log_sum = torch.empty(3, N, dtype=torch.float32, device=logits.device).unbind(0)
    if N:
        block, warps = _launch_config(V)
        _forward_kernel[(N,)](logits, target, loss, row_max, log_sum, V, logits.stride(0), ignore_index,
                              BLOCK_V=block, num_warps=warps)
    return loss, row_max, log_sum
