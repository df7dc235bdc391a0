"""Inter-chunk state passes of chunked KDA (the only sequential stages).

Forward, per sequence and head, over its chunks in order (S is the state at the chunk start, float32):

    h[c] = S;   δ = u − w S;   S ← exp(G_last) ⊙_rows S + kgᵀ δ

Backward, over the chunks in reverse, with dS the gradient of the chunk's *end* state:

    dh[c] = dS;   dδ = Aqkᵀ dO + kg dS;   dS ← exp(G_last) ⊙_rows dS + qgᵀ dO − wᵀ dδ

with qg = scale·q⊙Γ from the intra stage.

The state stays in float32 registers; the matrix products take input-dtype operands (tensor cores).
"""

import torch
import triton
import triton.language as tl

from ..launch import autotune
from ..utils import cdiv
from .prepare import BT

# Value-block width, warps and pipeline depth of the sequential passes (cdiv(V, BV) · N · H programs run at
# once; each step's loads do not depend on the state, so deeper pipelines hide their latency). The CPU
# interpreter runs the first config (kdamoe.kernels.utils.autotune); the GPU times them all. The backward pass loads six
# tiles per step: with 3 stages it needed 240 KB of shared memory on triton 3.6 (the H200 has 227 KB); the autotuner
# skips configs that do not fit.
_FWD_CONFIGS = [triton.Config({'BV': bv}, num_warps=w, num_stages=s)
                for bv, w, s in ((32, 4, 2), (32, 4, 3), (32, 4, 4), (64, 4, 3), (32, 2, 3), (16, 4, 3), (16, 2, 4))]
_BWD_CONFIGS = [triton.Config({'BV': bv}, num_warps=w, num_stages=s)
                for bv, w, s in ((32, 4, 2), (64, 4, 2), (32, 8, 2), (32, 4, 3), (16, 4, 3), (16, 4, 2), (64, 8, 1))]


@triton.jit
def _state_fwd_kernel(w, u, kg, G, h, vnew, h0, ht, h0_idx, cu_seqlens, chunk_offsets,
                      H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                      HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr, HAS_IDX: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    # the state row of sequence i_n in h0 / ht: its own, or its pool slot (initial_state_indices); a program reads
    # its [K, BV] block of that row before the loop and writes the same block after it, and no other program
    # touches it (distinct indices), so the final state may overwrite the initial one in place
    i_s = i_n.to(tl.int64)
    if HAS_IDX:
        i_s = tl.load(h0_idx + i_n).to(tl.int64)
    bos = tl.load(cu_seqlens + i_n)
    eos = tl.load(cu_seqlens + i_n + 1)
    c0 = tl.load(chunk_offsets + i_n)
    ck = tl.arange(0, K)
    cv = i_v * BV + tl.arange(0, BV)
    mv = cv < V
    soff = ck[:, None] * V + cv[None, :]
    if HAS_H0:
        S = tl.load(h0 + (i_s * H + i_h) * K * V + soff, mask=mv[None, :], other=0.)
    else:
        S = tl.zeros([K, BV], dtype=tl.float32)
    dt = w.dtype.element_ty
    NT = tl.cdiv(eos - bos, BT)
    for i_t in range(NT):
        t0 = bos + i_t * BT
        tl.store(h + ((c0 + i_t) * H + i_h).to(tl.int64) * K * V + soff, S.to(h.dtype.element_ty), mask=mv[None, :])
        rows = t0 + tl.arange(0, BT)
        mrow = rows < eos
        tok = (rows * H + i_h).to(tl.int64)
        b_w = tl.load(w + tok[:, None] * K + ck[None, :], mask=mrow[:, None], other=0.)
        b_u = tl.load(u + tok[:, None] * V + cv[None, :], mask=mrow[:, None] & mv[None, :], other=0.).to(tl.float32)
        d = b_u - tl.dot(b_w, S.to(dt))
        tl.store(vnew + tok[:, None] * V + cv[None, :], d.to(vnew.dtype.element_ty), mask=mrow[:, None] & mv[None, :])
        last = (tl.minimum(t0 + BT, eos) - 1) * H + i_h
        glast = tl.load(G + last.to(tl.int64) * K + ck)
        b_kg = tl.load(kg + tok[:, None] * K + ck[None, :], mask=mrow[:, None], other=0.)
        S = S * tl.exp(glast)[:, None] + tl.dot(tl.trans(b_kg), d.to(dt))
    if STORE_FINAL:
        tl.store(ht + (i_s * H + i_h) * K * V + soff, S, mask=mv[None, :])


# (the jit function keeps its name: profiles and benchmarks/floors.py find the kernel by it)
_state_fwd_tuned = autotune(configs=_FWD_CONFIGS, key=['H', 'K', 'V'])(_state_fwd_kernel)
# The same pass writing the final states into the pool it read them from (initial_state_indices): the autotuner's
# timing runs (each config several times, on the first call at a shape) must put the pool back after each run.
_state_fwd_pool_tuned = autotune(configs=_FWD_CONFIGS, key=['H', 'K', 'V'], restore_value=['ht'])(_state_fwd_kernel)


def state_fwd(w, u, kg, G, h0, cu_seqlens, chunk_offsets, NC, N, output_final_state, h0_indices=None):
    """Returns ``(h, vnew, ht)``: h ``[NC, H, K, V]`` chunk-start states (input dtype), vnew = δ like u,
    ht ``[N, H, K, V]`` float32 or None.

    With ``h0_indices`` (int ``[N]``, distinct), ``h0`` is a contiguous float32 pool ``[P, H, K, V]``: sequence n
    starts from ``h0[h0_indices[n]]`` and, with ``output_final_state``, its final state is written back there in
    place; ht is then None."""
    _, T, H, K = w.shape
    V = u.shape[-1]
    h = torch.empty(NC, H, K, V, dtype=w.dtype, device=w.device)
    vnew = torch.empty_like(u)
    grid = lambda meta: (cdiv(V, meta['BV']), N * H)
    if h0_indices is not None:
        kernel = _state_fwd_pool_tuned if output_final_state else _state_fwd_tuned
        kernel[grid](w, u, kg, G, h, vnew, h0, h0 if output_final_state else None, h0_indices, cu_seqlens,
                     chunk_offsets, H=H, K=K, V=V, BT=BT, HAS_H0=True, STORE_FINAL=bool(output_final_state),
                     HAS_IDX=True)
        return h, vnew, None
    ht = torch.empty(N, H, K, V, dtype=torch.float32, device=w.device) if output_final_state else None
    _state_fwd_tuned[grid](w, u, kg, G, h, vnew, h0, ht, None, cu_seqlens, chunk_offsets, H=H, K=K, V=V, BT=BT,
                           HAS_H0=h0 is not None, STORE_FINAL=output_final_state, HAS_IDX=False)
    return h, vnew, ht


@autotune(configs=_BWD_CONFIGS, key=['H', 'K', 'V'])
@triton.jit
def _state_bwd_kernel(qg, G, w, kg, do, dvl, dh, dvnew, dht, dh0, cu_seqlens, chunk_offsets,
                      H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                      HAS_DHT: tl.constexpr, HAS_H0: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens + i_n)
    eos = tl.load(cu_seqlens + i_n + 1)
    c0 = tl.load(chunk_offsets + i_n)
    ck = tl.arange(0, K)
    cv = i_v * BV + tl.arange(0, BV)
    mv = cv < V
    soff = ck[:, None] * V + cv[None, :]
    if HAS_DHT:
        dS = tl.load(dht + (i_n * H + i_h).to(tl.int64) * K * V + soff, mask=mv[None, :], other=0.)
    else:
        dS = tl.zeros([K, BV], dtype=tl.float32)
    dt = w.dtype.element_ty
    NT = tl.cdiv(eos - bos, BT)
    for j in range(NT):
        i_t = NT - 1 - j
        t0 = bos + i_t * BT
        tl.store(dh + ((c0 + i_t) * H + i_h).to(tl.int64) * K * V + soff, dS.to(dh.dtype.element_ty), mask=mv[None, :])
        rows = t0 + tl.arange(0, BT)
        mrow = rows < eos
        tok = (rows * H + i_h).to(tl.int64)
        koff = tok[:, None] * K + ck[None, :]
        voff = tok[:, None] * V + cv[None, :]
        b_kg = tl.load(kg + koff, mask=mrow[:, None], other=0.)
        mtv = mrow[:, None] & mv[None, :]
        dd = tl.load(dvl + voff, mask=mtv, other=0.) + tl.dot(b_kg, dS.to(dt))
        tl.store(dvnew + voff, dd.to(dvnew.dtype.element_ty), mask=mtv)
        b_qg = tl.load(qg + koff, mask=mrow[:, None], other=0.)
        b_do = tl.load(do + voff, mask=mtv, other=0.)
        b_w = tl.load(w + koff, mask=mrow[:, None], other=0.)
        last = (tl.minimum(t0 + BT, eos) - 1) * H + i_h
        glast = tl.load(G + last.to(tl.int64) * K + ck)
        dS = dS * tl.exp(glast)[:, None] + tl.dot(tl.trans(b_qg), b_do) \
            - tl.dot(tl.trans(b_w), dd.to(dt))
    if HAS_H0:
        tl.store(dh0 + (i_n * H + i_h).to(tl.int64) * K * V + soff, dS, mask=mv[None, :])


def state_bwd(qg, G, w, kg, do, dvl, dht, cu_seqlens, chunk_offsets, NC, N, need_dh0):
    """Returns ``(dh, dvnew, dh0)``: dh ``[NC, H, K, V]`` gradients of the chunk-end states (input dtype),
    dvnew = dδ ``[1, T, H, V]``, dh0 ``[N, H, K, V]`` float32 or None."""
    _, T, H, K = w.shape
    V = do.shape[-1]
    dh = torch.empty(NC, H, K, V, dtype=w.dtype, device=w.device)
    dvnew = torch.empty_like(do)
    dh0 = torch.empty(N, H, K, V, dtype=torch.float32, device=w.device) if need_dh0 else None
    grid = lambda meta: (cdiv(V, meta['BV']), N * H)
    _state_bwd_kernel[grid](qg, G, w, kg, do, dvl, dh, dvnew, dht, dh0, cu_seqlens, chunk_offsets,
                            H=H, K=K, V=V, BT=BT, HAS_DHT=dht is not None, HAS_H0=need_dh0)
    return dh, dvnew, dh0
