"""Routed experts as grouped GEMMs with a fused GLU epilogue (forward): public ``moe_experts`` and its autograd.

Inference on few routed rows (a decode step) takes the two-kernel GEMV path of ``gemv.py`` instead.
"""

import torch

from ..utils import cached_arange, cdiv, is_interpreter
from .activation import ACTIVATIONS
from .gemv import moe_experts_gemv
from .grouped_gemm import _combine_kernel, _gate_up_fwd_kernel, _glu_rows_bwd_kernel, _rows_gemm_kernel, _wgrad_kernel
from .permute import expert_permutation, tile_offsets

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)

# Most routed rows M = N·k that take the GEMV path (no gradient needed). The GEMV path reads an expert's
# weights once per routed row (rows sharing an expert share them only through L2); the grouped path reads
# them once per 64-row tile but pays ~20 launches of planning and ceil(M/64) + E tiles. At one decode step
# (N ≤ 8 tokens, k = 8) rows rarely share an expert and the launches dominate; far above, the grouped path's
# weight reuse wins. 64 = the largest decode batch of 8 tokens at top-8; the crossover is to be measured on the
# GPU (see docs/kernels.md). Tests set it to 0 to force the grouped path.
GEMV_MAX_ROWS = 64


def _block_m(num_rows: int, num_experts: int) -> int:
    """Rows per tile (the interpreter's too): 128 once experts average 192 rows or more, else 64."""
    return 128 if num_rows >= 192 * num_experts else 64


def _prec(dtype):
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_device(*tensors):
    dev = tensors[0].device
    for t in tensors:
        if t.device != dev:
            raise ValueError(f"moe_experts: all tensors must be on one device, got {t.device} and {dev}")
    if dev.type != "cuda" and not (dev.type == "cpu" and is_interpreter()):
        raise ValueError(f"moe_experts: Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got device {dev}")


def _validate(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation, check_index_values):
    if activation not in ACTIVATIONS:
        raise ValueError(f"moe_experts: activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    for name, t in (("hidden_states", hidden_states), ("top_k_index", top_k_index), ("top_k_weights", top_k_weights),
                    ("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"moe_experts: {name} must be a torch.Tensor, got {type(t).__name__}")
    if hidden_states.dim() != 2:
        raise ValueError(f"moe_experts: hidden_states must be [N, hidden], got shape {tuple(hidden_states.shape)}")
    if hidden_states.dtype not in _FLOATS:
        raise ValueError(f"moe_experts: hidden_states dtype must be float16/bfloat16/float32, "
                         f"got {hidden_states.dtype}")
    n, hid = hidden_states.shape
    if top_k_index.dim() != 2 or top_k_index.shape[0] != n:
        raise ValueError(f"moe_experts: top_k_index must be [N={n}, k], got shape {tuple(top_k_index.shape)}")
    if top_k_index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"moe_experts: top_k_index dtype must be int32 or int64, got {top_k_index.dtype}")
    k = top_k_index.shape[1]
    if k < 1 or k > 64:
        raise ValueError(f"moe_experts: top_k must be in [1, 64], got {k}")
    if tuple(top_k_weights.shape) != (n, k):
        raise ValueError(f"moe_experts: top_k_weights must be [N, k] = {(n, k)}, got {tuple(top_k_weights.shape)}")
    if top_k_weights.dtype not in _FLOATS:
        raise ValueError("moe_experts: top_k_weights dtype must be float16/bfloat16/float32, "
                         f"got {top_k_weights.dtype}")
    if gate_up_proj.dim() != 3 or gate_up_proj.shape[2] != hid or gate_up_proj.shape[1] % 2:
        raise ValueError(f"moe_experts: gate_up_proj must be [E, 2I, hidden={hid}], got {tuple(gate_up_proj.shape)}")
    e, two_i, _ = gate_up_proj.shape
    inter = two_i // 2
    if tuple(down_proj.shape) != (e, hid, inter):
        raise ValueError(f"moe_experts: down_proj must be [E, hidden, I] = {(e, hid, inter)}, "
                         f"got {tuple(down_proj.shape)}")
    if gate_up_proj.dtype != hidden_states.dtype or down_proj.dtype != hidden_states.dtype:
        raise ValueError(f"moe_experts: gate_up_proj ({gate_up_proj.dtype}) and down_proj ({down_proj.dtype}) must "
                         f"have the dtype of hidden_states ({hidden_states.dtype})")
    if e < 1 or inter < 1 or hid < 1:
        raise ValueError(f"moe_experts: empty expert weights {tuple(gate_up_proj.shape)}")
    _check_device(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj)
    # The value check reads the device on the host: skipped when the caller vouches for the indices (the model's
    # experts module, fed by its router kernel) and while a CUDA graph captures.
    if check_index_values and n > 0 and not (top_k_index.is_cuda and torch.cuda.is_current_stream_capturing()):
        bad = ((top_k_index < 0) | (top_k_index > e)).any()
        if bool(bad):
            raise ValueError(f"moe_experts: top_k_index values must lie in [0, num_experts={e}] "
                             f"(== {e} means skipped), got min {int(top_k_index.min())} max {int(top_k_index.max())}")


class _Plan:
    """Permutation and tile schedule shared by forward and backward.

    Block sizes are the GPU's under the interpreter too; only the number of launched programs differs
    there, in :func:`_interpreter_launch` alone.
    """

    def __init__(self, top_k_index, num_experts):
        self.n, self.k = top_k_index.shape
        self.m = self.n * self.k
        self.e = num_experts
        self.order, counts, self.row_offs = expert_permutation(top_k_index, num_experts)
        self.bm = _block_m(self.m, num_experts)
        self.tile_offs = tile_offsets(counts, self.bm)
        # upper bound Σ_e ceil(c_e/BM) <= ceil(M/BM) + E without a host sync; extra programs exit at once
        self.max_tiles = cdiv(self.m, self.bm) + num_experts
        # every expert, so empty experts store zero weight gradients and the gradients can be torch.empty
        # (both aranges are cached constants, read only: no launch per call)
        self.wgrad_experts = cached_arange(num_experts, torch.int32, top_k_index.device)
        if is_interpreter():
            _interpreter_launch(self, counts)
        tiles = cached_arange(self.max_tiles, torch.int32, top_k_index.device)
        self.tile_expert = torch.searchsorted(self.tile_offs[1:], tiles, right=True, out_int32=True)


def _interpreter_launch(plan: _Plan, counts: torch.Tensor) -> None:
    """Launch fewer programs under ``TRITON_INTERPRET=1`` (the GPU's tile plan otherwise unchanged).

    The CPU interpreter pays milliseconds per program, also for one that exits at once. The GPU's launch
    has ``ceil(M/BM) + E`` row tiles (an upper bound known without a host sync) and every expert in the
    weight-gradient kernels, i.e. about E programs that only exit or store zeros: with E = 1000 one test
    took 46 s instead of 12 s. Here, with a host sync that costs nothing on the CPU: the exact tile count
    plus one (so the early-exit path stays tested) and, for the weight gradients, the experts with rows plus
    two empty ones (the others' zero gradients then come from ``torch.zeros``, see ``MoEExpertsFunction``).

    Args:
        plan: the schedule to change in place (``max_tiles``, ``wgrad_experts``).
        counts: ``[E]`` int32 rows per expert.
    """
    plan.max_tiles = int(plan.tile_offs[-1]) + 1
    empty = torch.nonzero(counts == 0).flatten()[:2]
    experts = torch.cat([torch.nonzero(counts > 0).flatten(), empty])
    plan.wgrad_experts = torch.sort(experts).values.to(torch.int32)


def _rows_gemm(plan, a, b, out, n_out, k_dim, stride_am, stride_be, stride_bk, stride_bn, gather_a, sorted_out, prec):
    grid = lambda meta: (plan.max_tiles * cdiv(n_out, meta["BN"]),)
    _rows_gemm_kernel[grid](
        a, b, plan.order, plan.tile_expert, plan.tile_offs, plan.row_offs, out,
        plan.e, n_out, k_dim, plan.k, stride_am, stride_be, stride_bk, stride_bn,
        GATHER_A=gather_a, SORTED_OUT=sorted_out, PREC=prec, BM=plan.bm,
    )


# rows x columns per program of the element-wise GLU backward, 4 warps: 16 float32 values per thread and tile (16 x 128
# spilled 4 bytes compiled for sm_90a, 32 x 64 none: benchmarks/tuning/kernel_resources.py)
GLU_ROWS, GLU_COLS = 32, 64


def _glu_rows_bwd(plan, dg, h, w, dh, dw, act, betas):
    _glu_rows_bwd_kernel[(cdiv(plan.m, GLU_ROWS),)](
        dg, h, plan.order, plan.row_offs, w, dh, dw, plan.m, plan.e, dg.shape[1], betas[0], betas[1],
        ACT=act, BR=GLU_ROWS, BI=GLU_COLS, num_warps=4,
    )


def _wgrad(plan, a, b, out, p, q, stride_am, stride_bm, gather_a, gather_b, prec):
    n_exp = plan.wgrad_experts.numel()
    grid = lambda meta: (n_exp * cdiv(p, meta["BP"]) * cdiv(q, meta["BQ"]),)
    _wgrad_kernel[grid](
        a, b, plan.order, plan.row_offs, plan.wgrad_experts, out, plan.e, p, q, stride_am, stride_bm,
        TOPK=plan.k, GATHER_A=gather_a, GATHER_B=gather_b, PREC=prec,
    )


def _weight_grad_buffer(plan: _Plan, weight: torch.Tensor) -> torch.Tensor:
    """Uninitialised when the weight-gradient kernels write every expert, zeros when they skip some."""
    return torch.empty_like(weight) if plan.wgrad_experts.numel() == plan.e else torch.zeros_like(weight)


def _combine(y, top_k_index, out, num_experts):
    n, hid = out.shape
    bt, bl = 16, 256
    grid = (cdiv(n, bt), cdiv(hid, bl))
    _combine_kernel[grid](y, top_k_index, out, n, hid, num_experts, TOPK=top_k_index.shape[1], BT=bt, BL=bl,
                          num_warps=4)


class MoEExpertsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, act, beta1, beta2):
        x = hidden_states.contiguous()
        idx = top_k_index.contiguous()
        w = top_k_weights.contiguous()
        w1 = gate_up_proj.contiguous()
        w2 = down_proj.contiguous()
        n, hid = x.shape
        e, two_i, _ = w1.shape
        inter = two_i // 2
        plan = _Plan(idx, e)
        dt = x.dtype
        prec = _prec(dt)
        save_h = torch.is_grad_enabled() or any(ctx.needs_input_grad)
        # g_w = w · GLU(h) per sorted row, rounded to the input dtype once: the down projection y = g_w @ W2ᵀ is then
        # the weighted slot output, and ∂W2 = Σ ∂out[tok]ᵀ g_w a plain GEMM
        g = torch.empty(plan.m, inter, device=x.device, dtype=dt)
        h = torch.empty(plan.m if save_h else 1, two_i, device=x.device, dtype=dt)
        grid = lambda meta: (plan.max_tiles * cdiv(inter, meta["BN"]),)
        _gate_up_fwd_kernel[grid](
            x, w1, plan.order, plan.tile_expert, plan.tile_offs, plan.row_offs, w, g, h, e, inter, hid, beta1, beta2,
            TOPK=plan.k, ACT=act, SAVE_H=save_h, PREC=prec, BM=plan.bm,
        )
        y = torch.empty(plan.m, hid, device=x.device, dtype=dt)
        _rows_gemm(plan, g, w2, y, hid, inter, inter, hid * inter, 1, inter, gather_a=False, sorted_out=False,
                   prec=prec)
        out = torch.empty(n, hid, device=x.device, dtype=dt)
        _combine(y, idx, out, e)
        ctx.save_for_backward(x, idx, w, w1, w2, g, h)
        ctx.plan = plan
        ctx.act = act
        ctx.betas = (beta1, beta2)
        ctx.w_dtype = top_k_weights.dtype
        return out

    @staticmethod
    def backward(ctx, dout):
        x, idx, w, w1, w2, g, h = ctx.saved_tensors
        plan = ctx.plan
        n, hid = x.shape
        e, two_i, _ = w1.shape
        inter = two_i // 2
        dt = x.dtype
        prec = _prec(dt)
        dout = dout.to(dt).contiguous()
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        need_w1, need_w2 = ctx.needs_input_grad[3], ctx.needs_input_grad[4]
        # ∂g' = ∂out[tok] @ W2 per sorted row (unweighted), then ∂h (sorted rows) and ∂w (per slot) element-wise
        dg = torch.empty(plan.m, inter, device=x.device, dtype=dt)
        _rows_gemm(plan, dout, w2, dg, inter, hid, hid, hid * inter, inter, 1, gather_a=True, sorted_out=True,
                   prec=prec)
        dw = torch.empty(plan.m, device=x.device, dtype=torch.float32)
        dh = torch.empty(plan.m, two_i, device=x.device, dtype=dt)
        _glu_rows_bwd(plan, dg, h, w, dh, dw, ctx.act, ctx.betas)
        del dg
        dx = dw1 = dw2 = None
        if need_x:
            y = torch.empty(plan.m, hid, device=x.device, dtype=dt)
            _rows_gemm(plan, dh, w1, y, hid, two_i, two_i, two_i * hid, hid, 1, gather_a=False, sorted_out=False,
                       prec=prec)
            dx = torch.empty(n, hid, device=x.device, dtype=dt)
            _combine(y, idx, dx, e)
        if need_w1:
            dw1 = _weight_grad_buffer(plan, w1)
            _wgrad(plan, dh, x, dw1, two_i, hid, two_i, hid, gather_a=False, gather_b=True, prec=prec)
        if need_w2:
            dw2 = _weight_grad_buffer(plan, w2)
            _wgrad(plan, dout, g, dw2, hid, inter, hid, inter, gather_a=True, gather_b=False, prec=prec)
        dweights = dw.view(n, plan.k).to(ctx.w_dtype) if need_w else None
        return dx, None, dweights, dw1, dw2, None, None, None


def moe_experts(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation="situ",
                situ_beta=4.0, situ_linear_beta=25.0, *, check_index_values=True):
    """Routed experts with the weighted combine: ``out[t] = Σ_j w[t,j] · E_{idx[t,j]}(x[t])``.

    ``E_e(x) = down_proj[e] @ GLU(gate_up_proj[e, :I] @ x, gate_up_proj[e, I:] @ x)`` with
    SiTU-GLU ``GLU(a, b) = [β1·tanh(a/β1)·σ(a)] ⊙ [β2·tanh(b/β2)]`` (Kimi K3 report §2.3;
    β1 = ``situ_beta``, β2 = ``situ_linear_beta``) or SwiGLU ``silu(a)·b`` (``activation="silu"``).
    Expert layout follows transformers / LatentMoE (arXiv:2601.18089): the experts act on the latent width ℓ.

    Args:
        hidden_states: [N, ℓ] float16 / bfloat16 / float32 (CUDA, or CPU under ``TRITON_INTERPRET=1``).
        top_k_index: [N, k] int32/int64 expert ids in [0, E]; ``E`` (== num_experts) marks a slot owned by
            another rank (expert parallelism): it contributes nothing and gets zero weight gradient.
        top_k_weights: [N, k] routing weights, float16 / bfloat16 / float32 (its gradient has the same dtype).
        gate_up_proj: [E, 2I, ℓ], dtype of ``hidden_states``: gate rows ``[:I]`` then up rows ``[I:]``.
        down_proj: [E, ℓ, I], dtype of ``hidden_states``.
        activation: ``"situ"`` or ``"silu"``.
        situ_beta, situ_linear_beta: β1, β2 of SiTU-GLU (ignored for ``"silu"``).
        check_index_values: check that every index lies in [0, E]. The check copies one flag to the host, a device
            synchronisation that stalls the launch queue; pass False only for indices in range by construction
            (the model's router output). An index outside [0, E] then reads out of bounds.

    Returns:
        [N, ℓ] in the dtype of ``hidden_states``. Differentiable w.r.t. ``hidden_states``, ``top_k_weights``,
        ``gate_up_proj`` and ``down_proj`` (GEMMs accumulate in float32; the activation is evaluated in float32).

    Without a gradient to compute (``torch.no_grad`` / ``inference_mode``, or no float input requiring grad) and
    with at most ``GEMV_MAX_ROWS`` routed slots ``N·k`` (one decode step), two GEMV kernels of ``gemv.py`` run
    instead of the grouped GEMMs: no permutation plan, no host synchronisation, CUDA-graph capturable. Both
    paths accumulate in float32; before the down projection the grouped path rounds ``w · GLU(·)`` to the input
    dtype, the GEMV path ``GLU(·)`` (applying ``w`` in float32 after); the GEMV path sums the k slots in float32
    and rounds once, the grouped path rounds each slot first.

    Under ``torch.autocast`` the float inputs are cast to the autocast dtype first (float32 weights then get
    float32 gradients); otherwise all three float tensors must share one dtype.

    Raises:
        ValueError: bad shapes, dtypes, devices, activation, or index values outside [0, E] (the last check
            synchronises with the device once per call, see ``check_index_values``); bfloat16 on the grouped path
            under the CPU interpreter, whose bfloat16 ``tl.dot`` is wrong.
    """
    if (isinstance(hidden_states, torch.Tensor) and hidden_states.device.type in ("cuda", "cpu")  # autocast's types
            and torch.is_autocast_enabled(hidden_states.device.type)):
        # mixed precision (e.g. float32 master weights under bf16 autocast): compute in the autocast dtype, as
        # F.linear would; the casts are differentiable, so float32 weights receive float32 gradients
        amp = torch.get_autocast_dtype(hidden_states.device.type)
        hidden_states, gate_up_proj, down_proj = (
            t.to(amp) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
            for t in (hidden_states, gate_up_proj, down_proj))
    _validate(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation, check_index_values)
    needs_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (hidden_states, top_k_weights, gate_up_proj, down_proj))
    if not needs_grad and 0 < top_k_index.numel() <= GEMV_MAX_ROWS:
        return moe_experts_gemv(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
                                ACTIVATIONS[activation], float(situ_beta), float(situ_linear_beta))
    if is_interpreter() and hidden_states.dtype == torch.bfloat16:
        # Triton's CPU interpreter (3.7) computes tl.dot on bfloat16 operands wrongly (errors of order 1e9, no
        # warning); the grouped GEMMs would return garbage
        raise ValueError("moe_experts: bfloat16 inputs need a CUDA device; under TRITON_INTERPRET=1 the grouped "
                         "path's tl.dot is wrong in bfloat16 — use float32 or float16 on the CPU "
                         "(torch.autocast('cpu') defaults to bfloat16)")
    if hidden_states.shape[0] == 0:  # no tokens: an empty output that still connects every input to the graph
        zero = (top_k_weights.sum() * 0).to(hidden_states.dtype) + gate_up_proj.sum() * 0 + down_proj.sum() * 0
        return hidden_states * 0 + zero
    return MoEExpertsFunction.apply(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
                                    ACTIVATIONS[activation], float(situ_beta), float(situ_linear_beta))
