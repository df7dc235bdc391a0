"""The one place that picks a kernel backend; the modeling file never knows which one runs.

``config.kernel_backend``: ``"auto"`` uses the Triton kernels of ``kdamoe.kernels`` for CUDA tensors
when that package imports, PyTorch otherwise; ``"triton"`` insists on Triton (error if unavailable);
``"torch"`` always uses the pure-PyTorch reference ops.

The kernels are reached with an absolute import inside ``try/except ImportError`` on purpose:
transformers' remote-code copier follows every single-dot import in this file, and a saved checkpoint
must load with nothing but torch + transformers (DESIGN.md §6 "Remote-code imports").
"""

import functools

import torch

from .kda_torch import chunk_kda_torch, recurrent_kda_torch
from .moe_torch import moe_experts_torch


@functools.lru_cache(maxsize=None)
def _triton_kernels():
    """The ``kdamoe.kernels`` module, or None when it (or Triton) cannot be imported."""
    try:
        import kdamoe.kernels as kernels
    except ImportError:
        return None
    return kernels


def _use_triton(backend: str, device: torch.device, op: str) -> bool:
    kernels = _triton_kernels()
    available = kernels is not None and hasattr(kernels, op)
    if backend == "torch":
        return False
    if backend == "triton":
        if not available:
            raise RuntimeError(f"kernel_backend='triton' but kdamoe.kernels.{op} cannot be imported")
        if device.type != "cuda" and not _interpreter_on():
            raise RuntimeError(f"kernel_backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1); got {device}")
        return True
    return available and device.type == "cuda"


def _interpreter_on() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def chunk_kda_op(backend: str, device: torch.device, chunk_size: int = 32):
    """Chunked KDA op (training / prefill) with fla's ``chunk_kda`` signature.

    ``chunk_size`` applies to the PyTorch path only (the Triton kernels use their own).
    """
    if _use_triton(backend, device, "chunk_kda"):
        return _triton_kernels().chunk_kda
    return functools.partial(chunk_kda_torch, chunk_size=chunk_size)


def recurrent_kda_op(backend: str, device: torch.device):
    """Recurrent KDA op (decoding) with fla's ``fused_recurrent_kda`` signature."""
    if _use_triton(backend, device, "fused_recurrent_kda"):
        return _triton_kernels().fused_recurrent_kda
    return recurrent_kda_torch


def moe_experts_op(backend: str, device: torch.device):
    """Experts op ``fn(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, act)``.

    ``act`` is the experts module's activation (with ``hidden_act``, ``beta`` and ``linear_beta``
    attributes); the Triton op fuses it, the torch op calls it.
    """
    if _use_triton(backend, device, "moe_experts"):
        kernel = _triton_kernels().moe_experts

        def run(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, act):
            return kernel(
                hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
                activation=act.hidden_act, situ_beta=act.beta, situ_linear_beta=act.linear_beta,
            )

        return run
    return moe_experts_torch


from .moe_torch import moe_route_torch  # noqa: E402


def moe_route_op(backend: str, device: torch.device):
    """Router op ``fn(router_logits, e_score_correction_bias, top_k, routed_scaling_factor, token_mask,
    count_tokens, num_bins) -> (top_k_index, top_k_weights, tokens_per_expert, histogram)``.

    The Triton kernel ``kdamoe.kernels.moe_route`` (one pass: sigmoid, Top-(k+1), weights, token counts,
    QB histogram) or its PyTorch twin ``moe_torch.moe_route_torch``; both return float64 counts.
    """
    if _use_triton(backend, device, "moe_route"):
        return _triton_kernels().moe_route
    return moe_route_torch
