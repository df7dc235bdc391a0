"""The one place that picks a kernel backend; the modeling file never knows which one runs.

Fallback chain (docs/architecture.md §6), resolved on every call from ``config.kernel_backend`` and the
device of the inputs:

* ``"auto"``: on CUDA, the Triton kernels of ``kdamoe.kernels`` when that package imports, else
  flash-linear-attention (``fla``) when it imports, else PyTorch; on any other device always PyTorch.
* ``"triton"``: ``kdamoe.kernels`` or an error (CUDA tensors, or CPU under ``TRITON_INTERPRET=1``).
* ``"fla"``: fla or an error (CUDA tensors). The MoE experts have no fla kernel and run in PyTorch.
* ``"torch"``: the pure-PyTorch reference ops of ``kda_torch`` / ``moe_torch`` / ``mla_torch`` / ``norm_torch`` /
  ``attnres_torch``.

Kimi Linear's unbounded KDA gate (``lower_bound=None`` with ``use_gate_in_kernel``) is the one exception: the kdamoe
KDA kernels rely on the bounded gate, so :func:`chunk_kda` / :func:`fused_recurrent_kda` then run fla's ops on CUDA
under ``"auto"`` (PyTorch when fla does not import) and refuse ``"triton"``; the other ops keep the chain above.

The choice is per call and per device, unlike transformers' ``use_kernel_func_from_hub_with_fallback``,
which binds the package once at import time whatever the device. On top of that chain the layer ops
(:func:`causal_conv1d`, :func:`causal_conv1d_parts`, :func:`chunk_kda`, :func:`fused_recurrent_kda`) carry transformers'
hub-kernel hook (``use_kernel_forward_from_hub``; the KDA layer lists them with ``use_kernelized_func``),
so ``kernels.kernelize`` can swap in a Hub kernel when a user opts in. Every argument after ``beta`` / ``x``
is passed by keyword, in fla's names, so a Hub build of fla's ops accepts the same call.

Remote-code rule (docs/architecture.md §7): this file is copied next to saved weights, so it imports only
torch, transformers and same-folder modules (single-dot imports); ``kdamoe.kernels`` and ``fla`` are
reached by absolute import inside ``try/except`` and a saved folder loads with torch + transformers alone.
"""

import functools
import os
from types import SimpleNamespace

import torch
from transformers.integrations import use_kernel_forward_from_hub
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.utils import logging

from .attnres_torch import block_attnres_torch
from .kda_torch import causal_conv1d_torch, chunk_kda_torch, conv_final_state, recurrent_kda_torch
from .mla_torch import latent_attention_torch
from .moe_torch import moe_experts_torch, moe_route_torch
from .norm_torch import add_rms_norm_torch, gated_rms_norm_torch, rms_norm_torch

logger = logging.get_logger(__name__)

KERNEL_BACKENDS = ("auto", "triton", "fla", "torch")
_FLA_OPS = ("causal_conv1d", "chunk_kda", "fused_recurrent_kda")  # the ops fla has a kernel for


@functools.lru_cache(maxsize=None)
def kdamoe_kernels():
    """The ``kdamoe.kernels`` module, or None when it (or Triton) cannot be imported."""
    try:
        import kdamoe.kernels as kernels  # noqa: PLC0415 (kdamoe.kernels is optional in a remote-code folder: imported on first use, None when absent)
    except ImportError:
        return None
    return kernels


def _import_fla(module: str, names: tuple[str, ...]) -> dict:
    """``{name: fla function}`` from ``module``, or ``{}`` when it cannot be imported."""
    try:
        imported = __import__(module, fromlist=list(names))
        return {name: getattr(imported, name) for name in names}
    except Exception as error:  # fla's import touches Triton's driver and einops: any failure = "not usable"
        if not isinstance(error, ImportError) or "fla" not in str(error):
            logger.warning_once(f"flash-linear-attention's {module} does not import ({error!r}); not using it")
        return {}


@functools.lru_cache(maxsize=None)
def fla_kernels():
    """fla's (>= 0.6) KDA and short-conv ops as a namespace, or None when fla does not import at all; the
    two groups are imported separately, so a missing part leaves the other usable."""
    ops = {**_import_fla("fla.ops.kda", ("chunk_kda", "fused_recurrent_kda")),
           **_import_fla("fla.modules.causal_conv1d", ("causal_conv1d", "causal_conv1d_update"))}
    return SimpleNamespace(**ops) if ops else None


def _interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def select_backend(requested: str, device_type: str, have_kdamoe: bool, have_fla: bool,
                   interpreter: bool = False) -> str:
    """The implementation to run: ``"kdamoe"``, ``"fla"`` or ``"torch"`` (pure decision, no imports).

    Args:
        requested: ``config.kernel_backend``, one of :data:`KERNEL_BACKENDS`.
        device_type: the inputs' ``device.type`` (``"cuda"``, ``"cpu"``, ...).
        have_kdamoe / have_fla: whether ``kdamoe.kernels`` / fla provide this op here.
        interpreter: ``TRITON_INTERPRET=1`` (lets ``"triton"`` run on CPU tensors, for tests).

    Raises:
        ValueError: an unknown ``requested``.
        RuntimeError: ``"triton"`` / ``"fla"`` forced but the package is missing or the device is not CUDA.
    """
    if requested not in KERNEL_BACKENDS:
        raise ValueError(f"kernel_backend is {requested!r}; expected one of {KERNEL_BACKENDS}")
    if requested == "torch":
        return "torch"
    if requested == "triton":
        if not have_kdamoe:
            raise RuntimeError("kernel_backend='triton' but kdamoe.kernels (or Triton) cannot be imported")
        if device_type != "cuda" and not interpreter:
            raise RuntimeError(f"kernel_backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1); got {device_type}")
        return "kdamoe"
    if requested == "fla":
        if not have_fla:
            raise RuntimeError("kernel_backend='fla' but flash-linear-attention (fla >= 0.6) cannot be imported")
        if device_type != "cuda":
            raise RuntimeError(f"kernel_backend='fla' needs CUDA tensors; got {device_type}")
        return "fla"
    if device_type != "cuda":
        return "torch"
    return "kdamoe" if have_kdamoe else "fla" if have_fla else "torch"


def resolve(backend: str, device: torch.device, op: str) -> str:
    """:func:`select_backend` for ``op`` (a function name of ``kdamoe.kernels``) on ``device``."""
    if backend == "fla" and op not in _FLA_OPS:
        return "torch"  # no fla kernel for this op (the MoE experts)
    kernels = kdamoe_kernels()
    have_kdamoe = kernels is not None and hasattr(kernels, op)
    have_fla = op in _FLA_OPS and getattr(fla_kernels(), op, None) is not None
    return select_backend(backend, device.type, have_kdamoe, have_fla, _interpreter_on())


# The ops of a one-token decode step. Their kdamoe kernels read no device value on the host, which is what lets the
# step be captured in a CUDA graph (decode_graph.py); fla's and the PyTorch ops are not checked for that.
_DECODE_OPS = ("causal_conv1d", "fused_recurrent_kda", "moe_route", "moe_experts", "latent_attention", "rms_norm",
               "gated_rms_norm", "block_attnres")


def decode_graphs_supported(backend: str, device: torch.device, bounded_gate: bool = True) -> bool:
    """True when every op of a decode step runs a kdamoe kernel on ``device`` (CUDA only): the condition for
    replaying decode steps from a CUDA graph. ``bounded_gate=False`` (the KDA layers use Kimi Linear's unbounded gate,
    ``kda_lower_bound=None``) is always False: their KDA op then runs fla's or PyTorch's, never a kdamoe kernel."""
    if device.type != "cuda" or not bounded_gate:
        return False
    try:
        return all(resolve(backend, device, op) == "kdamoe" for op in _DECODE_OPS)
    except (RuntimeError, ValueError):
        return False


def _unbounded_gate_backend(backend: str, device: torch.device, op: str) -> str:
    """The KDA implementation for the unbounded gate where :func:`resolve` picked ``"kdamoe"``: fla's op when it
    imports (``"auto"``), else PyTorch's.

    Raises:
        ValueError: ``backend="triton"``: the kdamoe chunk kernel anchors 16-token sub-chunks and needs the bounded
            gate (``15·|g| ≤ 75 ≪ ln(FLT_MAX) ≈ 88.7``); an unbounded ``g`` would overflow its exponentials.
    """
    if backend == "triton":
        raise ValueError("kernel_backend='triton' cannot run the unbounded KDA gate (lower_bound=None): kdamoe's "
                         "Triton KDA kernels rely on the bounded gate (15*|g| <= 75 << ln(FLT_MAX) ~= 88.7); use "
                         "'auto', 'fla' or 'torch'")
    return "fla" if device.type == "cuda" and getattr(fla_kernels(), op, None) is not None else "torch"


# ----------------------------------------------------------------------------------------------------
# Short convolution
# ----------------------------------------------------------------------------------------------------
def _is_decode_step(x, conv_state, seq_idx, weight) -> bool:
    """One token per row with a cache and nothing to differentiate: the single-launch update kernels apply."""
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or conv_state.requires_grad)
    return x.shape[1] == 1 and seq_idx is None and not needs_grad


def _row_sequences(seq_idx: torch.Tensor):
    """``(cu_seqlens [N+1] int32 over the flattened B·T tokens, first [B])``: runs of equal ids, split at rows."""
    B, T = seq_idx.shape
    starts = torch.ones_like(seq_idx, dtype=torch.bool)
    starts[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    positions = starts.flatten().nonzero().flatten()
    cu_seqlens = torch.cat([positions, positions.new_tensor([B * T])]).to(torch.int32)
    first = starts.flatten().long().cumsum(0).view(B, T)[:, 0] - 1  # index of each row's first sequence
    return cu_seqlens, first


def _fla_causal_conv1d(fla, x, weight, conv_state, seq_idx, output_final_state=True):
    """fla's ``causal_conv1d(activation="silu")`` with kdamoe's arguments: ``seq_idx`` becomes ``cu_seqlens``
    over the flattened batch, the cached row state seeds each row's first sequence only."""
    x = x.contiguous()  # the KDA layer passes column slices of its fused projection; fla's kernel reads dense rows
    B, T, C = x.shape
    W = weight.shape[1]
    if conv_state is not None and _is_decode_step(x, conv_state, seq_idx, weight):
        state = conv_state.to(x.dtype).contiguous().clone()  # fla updates the cache in place
        y, _ = fla.causal_conv1d_update(x, state, weight=weight, activation="silu")
        return y, state
    if seq_idx is None:
        y, _ = fla.causal_conv1d(x, weight=weight, initial_state=conv_state, activation="silu")
    else:
        cu_seqlens, first = _row_sequences(seq_idx)
        initial_state = None
        if conv_state is not None:
            initial_state = conv_state.new_zeros(cu_seqlens.numel() - 1, C, W).index_copy(0, first, conv_state)
        y, _ = fla.causal_conv1d(x.reshape(1, B * T, C), weight=weight, initial_state=initial_state,
                                 activation="silu", cu_seqlens=cu_seqlens)
        y = y.view(B, T, C)
    # The returned state follows kdamoe's definition (the row's last W inputs of its last sequence).
    return y, conv_final_state(x, conv_state, seq_idx, W) if output_final_state else None


@use_kernel_forward_from_hub("kdamoe_causal_conv1d")
def causal_conv1d(x, weight, conv_state=None, seq_idx=None, *, output_final_state=True, backend="auto"):
    """The KDA layer's short conv: ``(SiLU(causal depthwise conv(x)) [B, T, C], new_state [B, C, W])``.

    Semantics, shapes and errors of :func:`kda_torch.causal_conv1d_torch` (x ``[B, T, C]``, weight ``[C, W]``,
    conv_state ``[B, C, W]``, seq_idx ``[B, T]``); outputs in x's dtype. ``new_state`` is None when
    ``output_final_state`` is False (fla's argument: a forward with no cache to fill skips its few launches). A
    one-token step with a cache and no gradient runs the single-launch update kernel of the backend.
    """
    impl = resolve(backend, x.device, "causal_conv1d")
    if impl == "kdamoe":
        kernels = kdamoe_kernels()
        if conv_state is not None and _is_decode_step(x, conv_state, seq_idx, weight):
            return kernels.causal_conv1d_update(x, conv_state, weight)
        return kernels.causal_conv1d(x, weight, conv_state, seq_idx, output_final_state=output_final_state)
    if impl == "fla":
        return _fla_causal_conv1d(fla_kernels(), x, weight, conv_state, seq_idx, output_final_state)
    y, new_state = causal_conv1d_torch(x, weight, conv_state, seq_idx)
    return y, new_state if output_final_state else None


MAX_CONV_PARTS = 3  # kdamoe.kernels.conv's MAX_PARTS (q, k, v); a limit on every backend, so each raises alike


@use_kernel_forward_from_hub("kdamoe_causal_conv1d_parts")
def causal_conv1d_parts(x, weight, conv_state=None, seq_idx=None, *, parts, output_final_state=True, backend="auto"):
    """:func:`causal_conv1d` over channels made of ``parts`` equal parts, the output split into them: the KDA layer's
    short conv of q, k and v, ``x`` the q|k|v columns of its fused projection. Returns ``(ys, new_state)``: ``ys`` a
    tuple of ``parts`` tensors ``[B, T, C / parts]`` (part i = channels ``[i·C/parts, (i+1)·C/parts)``), ``new_state``
    ``[B, C, W]`` over all channels (None unless ``output_final_state``), both in x's dtype.

    The backend is :func:`causal_conv1d`'s. The kdamoe kernels run it as one op (``kdamoe.kernels.causal_conv1d_parts``:
    one forward launch reading x in place and writing each part to its own contiguous tensor; in the backward one
    ``dx [B, T, C]``, the gradient of x itself, from two launches whatever ``parts`` is). fla, PyTorch and a decode
    step (one token on a cache, no gradient: the single update launch) run :func:`causal_conv1d` once over the C
    channels and return column views of its output.

    Raises:
        ValueError: ``parts`` not an int in [1, 3] dividing C (before any backend runs); the errors of
            :func:`causal_conv1d` otherwise.
    """
    if isinstance(parts, bool) or not isinstance(parts, int) or not 1 <= parts <= MAX_CONV_PARTS or (
            isinstance(x, torch.Tensor) and x.dim() == 3 and x.shape[-1] % parts):
        raise ValueError(f"parts must be an int in [1, {MAX_CONV_PARTS}] dividing x's channels "
                         f"({getattr(x, 'shape', None)}), got {parts!r}")
    impl = resolve(backend, x.device, "causal_conv1d")
    if impl == "kdamoe" and not (conv_state is not None and _is_decode_step(x, conv_state, seq_idx, weight)):
        return kdamoe_kernels().causal_conv1d_parts(x, weight, conv_state, seq_idx, parts=parts,
                                                    output_final_state=output_final_state)
    y, new_state = causal_conv1d(x, weight, conv_state, seq_idx, output_final_state=output_final_state,
                                 backend=backend)
    return y.chunk(parts, dim=-1), new_state


# ----------------------------------------------------------------------------------------------------
# Kimi Delta Attention
# ----------------------------------------------------------------------------------------------------
def _kda_call(impl, name, q, k, v, g, beta, common, gate):
    """Run the chunked / recurrent op of ``impl`` (``"kdamoe"`` or ``"fla"``) with fla's keyword arguments;
    ``common`` and ``gate`` are the keyword arguments of :func:`chunk_kda` without and with the gate."""
    if impl == "kdamoe":
        lower_bound = -5.0 if gate["lower_bound"] is None else gate["lower_bound"]
        return getattr(kdamoe_kernels(), name)(q, k, v, g, beta, **common, **dict(gate, lower_bound=lower_bound))
    # fla: float32 initial state (asserted by chunk_kda); safe_gate relies on g >= lower_bound, which the
    # lower-bounded gate guarantees (and fla refuses it without a lower bound).
    if common["initial_state"] is not None:
        common = dict(common, initial_state=common["initial_state"].float())
    if gate["use_gate_in_kernel"] and gate["lower_bound"] is None and gate["A_log"] is None:
        # fla's unbounded gate requires A_log; zeros give the scale exp(0) = 1 that A_log=None means here.
        gate = dict(gate, A_log=torch.zeros(q.shape[-2], dtype=torch.float32, device=q.device))
    extra = dict(safe_gate=True) if name == "chunk_kda" and gate["lower_bound"] is not None else {}
    return getattr(fla_kernels(), name)(q, k, v, g, beta, **common, **gate, **extra)


def _kda_impl(backend, device, op, gate) -> str:
    """:func:`resolve` for a KDA op, moved off the kdamoe kernels for the unbounded gate
    (:func:`_unbounded_gate_backend`)."""
    impl = resolve(backend, device, op)
    if impl == "kdamoe" and gate["use_gate_in_kernel"] and gate["lower_bound"] is None:
        impl = _unbounded_gate_backend(backend, device, op)
    return impl


@use_kernel_forward_from_hub("chunk_kda")
def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, cu_seqlens=None, use_gate_in_kernel=False, A_log=None, dt_bias=None,
              lower_bound=None, backend="auto", chunk_size=32):
    """Chunked KDA (training / prefill) with fla's ``chunk_kda`` arguments; returns ``(o, final_state)``.

    Shapes, dtypes and errors of :func:`kda_torch.chunk_kda_torch`. With ``use_gate_in_kernel`` ``g`` is the
    raw gate input and ``g = lower_bound · σ(exp(A_log) · (g + dt_bias))`` (``lower_bound=None``: Kimi Linear's
    ``g = −exp(A_log) · softplus(g + dt_bias)``) is computed by the backend (inside the kernel for kdamoe / fla). The
    unbounded gate never runs the kdamoe kernel: ``"auto"`` takes fla's op on CUDA when fla imports, else PyTorch's,
    and ``backend="triton"`` raises ValueError. ``chunk_size`` applies to the PyTorch path only.
    """
    gate = dict(use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    impl = _kda_impl(backend, q.device, "chunk_kda", gate)
    common = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)
    if impl == "torch":
        return chunk_kda_torch(q, k, v, g, beta, **common, chunk_size=chunk_size, **gate)
    return _kda_call(impl, "chunk_kda", q, k, v, g, beta, common, gate)


@use_kernel_forward_from_hub("fused_recurrent_kda")
def fused_recurrent_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=False, cu_seqlens=None, use_gate_in_kernel=False, A_log=None,
                        dt_bias=None, lower_bound=None, backend="auto"):
    """Recurrent KDA (decoding, forward only on the kernel backends) with fla's ``fused_recurrent_kda``
    arguments; the same call, backend choice and results as :func:`chunk_kda`."""
    gate = dict(use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    impl = _kda_impl(backend, q.device, "fused_recurrent_kda", gate)
    common = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)
    if impl == "torch":
        return recurrent_kda_torch(q, k, v, g, beta, **common, **gate)
    return _kda_call(impl, "fused_recurrent_kda", q, k, v, g, beta, common, gate)


# ----------------------------------------------------------------------------------------------------
# MoE experts
# ----------------------------------------------------------------------------------------------------
def moe_experts_op(backend: str, device: torch.device):
    """Experts op ``fn(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, act)``.

    ``act`` is the experts module's activation (with ``hidden_act``, ``beta`` and ``linear_beta``
    attributes); the Triton op fuses it, the torch op calls it. fla has no MoE kernel: ``"fla"`` and an
    ``"auto"`` without ``kdamoe.kernels`` use the torch op. The op is the model's (its indices come from the
    router kernel, in ``[0, E]`` by construction), so the Triton op skips its index-value check: that check's
    device sync, once per MoE layer, would stall the launch queue of every training step.
    """
    if resolve(backend, device, "moe_experts") == "kdamoe":
        kernel = kdamoe_kernels().moe_experts

        def run(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, act):
            return kernel(
                hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
                activation=act.hidden_act, situ_beta=act.beta, situ_linear_beta=act.linear_beta,
                check_index_values=False,
            )

        return run
    return moe_experts_torch


# ----------------------------------------------------------------------------------------------------
# MoE routing
# ----------------------------------------------------------------------------------------------------
def moe_route_op(backend: str, device: torch.device):
    """Router op ``fn(router_logits, e_score_correction_bias, top_k, routed_scaling_factor, token_mask,
    count_tokens, num_bins) -> (top_k_index, top_k_weights, tokens_per_expert, histogram)``.

    The Triton kernel ``kdamoe.kernels.moe_route`` (one pass: sigmoid, Top-(k+1), weights, token counts,
    QB histogram) or its PyTorch twin ``moe_torch.moe_route_torch``; both return float64 counts. fla has no
    routing kernel: ``"fla"`` and an ``"auto"`` without ``kdamoe.kernels`` use the torch op.
    """
    if resolve(backend, device, "moe_route") == "kdamoe":
        return kdamoe_kernels().moe_route
    return moe_route_torch


# ----------------------------------------------------------------------------------------------------
# RMSNorm and the gated RMSNorm of the KDA output
# ----------------------------------------------------------------------------------------------------
def rms_norm(x, weight, eps, *, backend="auto"):
    """RMSNorm over the last dim in float32, rounded to x's dtype, times ``weight``: ``[..., D]`` in
    ``promote_types(x.dtype, weight.dtype)``.

    Semantics, shapes and errors of :func:`norm_torch.rms_norm_torch` (x ``[..., D]``, weight ``[D]``); the
    kdamoe kernel (one launch forward, one backward, D ≤ 8192) runs on CUDA or under the interpreter with
    ``backend="triton"``; fla's norm is not used (``"fla"`` runs the torch op).
    """
    if resolve(backend, x.device, "rms_norm") == "kdamoe":
        return kdamoe_kernels().rms_norm(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


def add_rms_norm(x, residual, weight, eps, *, backend="auto"):
    """A residual add and the pre-norm after it: ``(h = x + residual, rms_norm(h, weight, eps))``.

    Semantics, shapes and errors of :func:`norm_torch.add_rms_norm_torch`; the backend choice of :func:`rms_norm`
    (the kdamoe kernel: one launch forward writing h and the norm, one backward adding h's own gradient).
    """
    if not isinstance(x, torch.Tensor):  # read for the backend choice, before either op checks its arguments
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if resolve(backend, x.device, "rms_norm") == "kdamoe":
        return kdamoe_kernels().add_rms_norm(x, residual, weight, eps)
    return add_rms_norm_torch(x, residual, weight, eps)


def gated_rms_norm(x, gate, weight, eps, *, backend="auto"):
    """The KDA output norm ``cast_x(RMSNorm(x) · σ(gate))``: ``[..., D]`` in x's dtype.

    Semantics, shapes and errors of :func:`norm_torch.gated_rms_norm_torch` (gate of x's shape); the backend
    choice of :func:`rms_norm`.
    """
    if resolve(backend, x.device, "gated_rms_norm") == "kdamoe":
        return kdamoe_kernels().gated_rms_norm(x, gate, weight, eps)
    return gated_rms_norm_torch(x, gate, weight, eps)


# ----------------------------------------------------------------------------------------------------
# Block Attention Residuals mix
# ----------------------------------------------------------------------------------------------------
def block_attnres(sources, query, key_weight, eps, *, backend="auto"):
    """The Block AttnRes mix ``Σ_i softmax_i(q · RMSNorm_γ(v_i)) v_i`` over ``S`` sources (arXiv:2603.15031):
    ``[..., d]`` in the sources' promoted dtype.

    Semantics, shapes and errors of :func:`attnres_torch.block_attnres_torch`: ``sources`` a list / tuple of
    ``[..., d]`` tensors (finished block sums, then the current partial sum), ``query`` and ``key_weight`` ``[d]``.
    The kdamoe kernel (one launch forward, one backward, sources read in place: no stacked copy) runs on CUDA or
    under the interpreter with ``backend="triton"``; fla has no such kernel (``"fla"`` runs the torch op). The
    backend is chosen on ``query``'s device (the kernel checks that the sources are on it).
    """
    if resolve(backend, query.device, "block_attnres") == "kdamoe":
        return kdamoe_kernels().block_attnres(sources, query, key_weight, eps)
    return block_attnres_torch(sources, query, key_weight, eps)


# ----------------------------------------------------------------------------------------------------
# MLA latent attention
# ----------------------------------------------------------------------------------------------------
def latent_attention(q, latent, seq_len, scale, key_mask=None, value_dim=None, *, backend="auto"):
    """Causal multi-query attention over the MLA latent cache (keys = the cached rows, values = their first
    ``value_dim`` columns, absorbed up-projections): ``o_lat [B, T, H, value_dim]`` in q's dtype.

    Semantics, shapes and errors of :func:`mla_torch.latent_attention_torch`: q ``[B, T, H, Dk]``, latent
    ``[B, S_cap, Dk]``, seq_len an int32/int64 device tensor ``[]`` / ``[1]`` (valid rows, the T new tokens
    included), optional key_mask ``[B, S_mask]``, ``value_dim`` (None → ``Dk``). The kdamoe kernel (flash-decoding,
    Triton) runs on CUDA or under the interpreter with ``backend="triton"``; fla has no such kernel, so ``"fla"`` runs
    the torch op. Neither path synchronises with the host (CUDA-graph capturable). The kernel is forward only: a call
    that needs a gradient (grad mode on and q or latent requiring one, e.g. a training forward continuing a cache) runs
    the differentiable torch op.
    """
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or latent.requires_grad)
    if not needs_grad and resolve(backend, q.device, "latent_attention") == "kdamoe":
        return kdamoe_kernels().latent_attention(q, latent, seq_len, scale, key_mask, value_dim=value_dim)
    return latent_attention_torch(q, latent, seq_len, scale, key_mask, value_dim=value_dim)


# ----------------------------------------------------------------------------------------------------
# GLU activation of the dense MLP and the shared experts
# ----------------------------------------------------------------------------------------------------
def glu_activation(gate, up, act_fn, *, backend="auto"):
    """``act_fn(gate, up)`` of a dense gated MLP: ``[*, I]`` in gate's dtype.

    ``gate`` / ``up`` are ``[*, I]`` (the outputs of ``gate_proj`` / ``up_proj``); ``act_fn`` is a
    :class:`moe_torch.GLUActivation` (``hidden_act``, ``beta``, ``linear_beta``). The kdamoe kernel
    (``kdamoe.kernels.glu``: one fused Triton kernel forward, one backward, float32 inside) runs on CUDA or under
    the interpreter with ``backend="triton"``; elsewhere, and for ``"fla"`` (no such kernel), ``act_fn`` itself
    runs. The kernel raises ValueError for inputs it cannot take (e.g. float64 or mixed dtypes).
    """
    if resolve(backend, gate.device, "glu") == "kdamoe":
        return kdamoe_kernels().glu(gate, up, act_fn.hidden_act, act_fn.beta, act_fn.linear_beta)
    return act_fn(gate, up)


# ----------------------------------------------------------------------------------------------------
# Causal-LM cross-entropy
# ----------------------------------------------------------------------------------------------------
def causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, *,
                   backend="auto"):
    """transformers' ``ForCausalLMLoss`` (the same arguments and result: shifted labels or ``shift_labels``,
    ``ignore_index``, sum / ``num_items_in_batch`` or the mean, a float32 0-d loss) on logits ``[..., V]``.

    The kdamoe kernel (``kdamoe.kernels.loss``: one launch forward, one backward, reading float16 / bfloat16 /
    float32 logits in place, no float32 copy) runs on CUDA or under the interpreter with ``backend="triton"``; else,
    and for ``"fla"`` (no such kernel), transformers' ``ForCausalLMLoss`` itself. The kernel raises ValueError for
    inputs it cannot take (e.g. float64 logits) and does not read target values on the host (see
    ``kdamoe.kernels.loss.causal_lm_loss``).
    """
    if resolve(backend, logits.device, "causal_lm_loss") == "kdamoe":
        return kdamoe_kernels().causal_lm_loss(logits, labels, vocab_size, num_items_in_batch, ignore_index,
                                               shift_labels)
    return ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                           ignore_index=ignore_index, shift_labels=shift_labels)


HUB_KERNEL_ARGUMENTS = ("use_kernels", "kernel_config", "kernels_mode", "allow_all_kernels")


def hub_kernels_off_by_default(kwargs: dict) -> dict:
    """``from_pretrained``'s keyword arguments with ``use_kernels=False`` added unless they ask for Hub kernels.

    transformers 5.25 made ``use_kernels`` default to on: every load then runs ``kernels.kernelize`` with
    transformers' own kernel mapping (the ``kernels`` package is one of its dependencies), which names a Hub build of
    fla for ``chunk_kda`` and ``fused_recurrent_kda`` on CUDA. kdamoe's KDA layer exposes its ops under those names
    (docs/architecture.md, "Hub kernels (opt-in)"), so a default GPU load would fetch that code from the Hub and run it
    in place of kdamoe's kernels, and on every device it logs a warning for each of kdamoe's conv names. The call asks
    for kernels with ``use_kernels=True``, a ``kernel_config``, a ``kernels_mode`` or ``allow_all_kernels=True``
    (transformers 5.24's default; an explicit ``use_kernels=None``, 5.25's "default", means off too);
    ``model.set_use_kernels(True)`` also opts in later and ``USE_HUB_KERNELS=NO`` keeps them off either way.
    """
    if all(kwargs.get(name) in (None, False) for name in HUB_KERNEL_ARGUMENTS):
        return {**kwargs, "use_kernels": False}
    return kwargs

