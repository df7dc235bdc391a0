"""PyTorch KDAMoE: Kimi Delta Attention + MLA (NoPE) + Quantile-Balanced Stable LatentMoE + Block AttnRes.

Reads top to bottom in the order data flows: norms and MLPs, the two token mixers (KDA, MLA), the
router and MoE block, Block Attention Residuals, the decoder layer, then the model classes.
Formulas and their sources are in docs/architecture.md and in the flat modules this file imports
(``kda_torch``, ``moe_torch``, ``quantile_balancing``). Which kernels run is decided in
``kernel_dispatch`` alone.
"""

import contextlib
import math
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right
from torch.optim.optimizer import register_optimizer_step_post_hook
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.dynamic_module_utils import custom_object_save
from transformers.generation import GenerationMixin
from transformers.integrations import use_experts_implementation, use_kernelized_func
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.masking_utils import create_causal_mask, create_recurrent_attention_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    MoeCausalLMOutputWithPast,
    MoeModelOutputWithPast,
    SequenceClassifierOutputWithPast,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.models.llama.modeling_llama import eager_attention_forward
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
from transformers.utils import can_return_tuple, logging
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .cache_kdamoe import KDAMoECache, KDAMoELatentCacheLayer, attention_seq_length
from .checkpoint_formats import read_config_dict
from .configuration_kdamoe import KDAMoEConfig, check_prefill_chunk_size
from .decode_graph import DecodeGraph
from .kernel_dispatch import (
    add_rms_norm,
    block_attnres,
    causal_conv1d,
    causal_conv1d_parts,
    causal_lm_loss,
    chunk_kda,
    decode_graphs_supported,
    fused_recurrent_kda,
    gated_rms_norm,
    glu_activation,
    hub_kernels_off_by_default,
    latent_attention,
    moe_experts_op,
    moe_route_op,
    rms_norm,
)
from .kimi_k3_format import from_kimi_k3_pretrained, is_kimi_k3_config
from .kimi_linear_format import from_kimi_linear_pretrained, is_kimi_linear_config
from .moe_torch import GLUActivation, moe_experts_torch
from .quantile_balancing import all_reduce_sum, histogram_range, quantile_balancing_update, sign_update
from .validation import check_cache_matches, inputs_are_prevalidated, validate_model_inputs

logger = logging.get_logger(__name__)


# ----------------------------------------------------------------------------------------------------
# Norms and dense MLPs
# ----------------------------------------------------------------------------------------------------
def fused_linear(
    hidden_states: torch.Tensor, modules: tuple[nn.Module | tuple[nn.Module, ...], ...]
) -> tuple[torch.Tensor, ...]:
    """``tuple(m(hidden_states) for m in modules)`` for projections that read the same input.

    When every module is a plain ``nn.Linear`` without bias, the outputs come from one GEMM over the concatenated
    weights, returned as column views of its output (exact: each output column is the same dot product); consumers
    read the views in place (the KDA layer's conv takes their row stride). Autograd's backward concatenates the
    outputs' gradients into one ``[N, Σ out]`` tensor for one GEMM each for ∂x and ∂W: for the model's groups that
    moves fewer bytes than a GEMM per output, which would pass over ``∂x`` and ``x`` once more per further output
    (``3·(n − 1)·in_features`` against ``2·Σ out`` elements per token; only the dense MLP's wide gate|up is the other
    way round, one layer). A decode step
    launches one kernel instead of ``len(modules)``, and at one token per row each small GEMM costs its launch
    latency, not its bytes. The concatenation of the weights is redone on every call (one copy of the weights, a
    few MB) so that in-place weight updates — an optimizer step, a captured CUDA graph replayed after one — are
    always seen. A module that is not plain (:func:`_is_plain_linear`: a PEFT LoRA layer, a forward hook, an offload
    hook) makes every module run on its own.

    An entry of ``modules`` may be a tuple of modules (a group): its output is one ``[..., Σ out_features]`` tensor,
    their outputs side by side in that order; in the fused case one view, so the split's backward takes the group's
    gradient as one piece (the KDA layer's q|k|v: its short conv reads them as one input and returns one gradient,
    :meth:`KDAMoEDeltaAttention._short_conv`); when the modules run on their own, their outputs are concatenated.

    Args:
        hidden_states: ``[..., in_features]``.
        modules: the projections or groups of projections, all with ``in_features`` inputs.

    Returns:
        ``[..., out_features]`` per entry (a group's: the sum of its modules'), in the GEMM's dtype; in the fused case
        views of one ``[..., Σ out_features]`` tensor (row stride ``Σ out_features``).
    """
    groups = [entry if isinstance(entry, tuple) else (entry,) for entry in modules]
    if all(_is_plain_linear(m) for group in groups for m in group):
        weight = torch.cat([m.weight for group in groups for m in group])
        return F.linear(hidden_states, weight).split([sum(m.out_features for m in g) for g in groups], dim=-1)
    outs = [[m(hidden_states) for m in group] for group in groups]
    return tuple(o[0] if len(o) == 1 else torch.cat(o, dim=-1) for o in outs)


def _is_plain_linear(module: nn.Module) -> bool:
    """A bias-free ``nn.Linear`` whose call is just ``F.linear``: no forward (pre-)hooks of its own or global ones
    (observers, steering), no replaced ``forward`` (accelerate's offload hooks), no subclass (PEFT, parametrize)."""
    return (type(module) is nn.Linear and module.bias is None and not module._forward_hooks
            and not module._forward_pre_hooks and "forward" not in vars(module)
            and not nn.modules.module._global_forward_hooks and not nn.modules.module._global_forward_pre_hooks)


class KDAMoERMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in float32 (Zhang & Sennrich 2019): ``weight · cast_x(x̂ / rms(x̂))``.

    ``kernel_dispatch.rms_norm`` runs it (the fused kernel on CUDA, ``norm_torch`` elsewhere), choosing from
    ``config.kernel_backend`` at every call; built without a config (``KDAMoERMSNorm(hidden_size, eps)``) it
    uses ``"auto"``.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, config: KDAMoEConfig | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps
        self.config = config

    @property
    def kernel_backend(self) -> str:
        return self.config.kernel_backend if self.config is not None else "auto"

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None):
        """``[..., D]`` → the norm ``[..., D]``; with ``residual`` (hidden_states' shape) → ``(h, norm(h))`` for
        ``h = hidden_states + residual``, the residual add fused into the norm (``kernel_dispatch.add_rms_norm``).

        The decoder layer's ``post_attention_layernorm`` is called the second way in the standard residual stream
        (``attnres_num_blocks = 0``): a forward hook on it sees the inputs ``(mixed, residual)`` and the output
        ``(h, normed)``."""
        if residual is None:
            return rms_norm(hidden_states, self.weight, self.variance_epsilon, backend=self.kernel_backend)
        return add_rms_norm(hidden_states, residual, self.weight, self.variance_epsilon, backend=self.kernel_backend)


class KDAMoEGatedRMSNorm(KDAMoERMSNorm):
    """Per-head RMSNorm of the KDA output times a sigmoid output gate: ``cast_x(RMSNorm(o) ⊙ σ(gate))``, one
    fused kernel on CUDA (``kernel_dispatch.gated_rms_norm``)."""

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(hidden_states, gate, self.weight, self.variance_epsilon, backend=self.kernel_backend)


class KDAMoEMLP(nn.Module):
    """Dense gated MLP ``down(act(gate(x), up(x)))`` with SiTU-GLU or SwiGLU (dense layers, shared experts).

    The activation goes through ``kernel_dispatch.glu_activation`` (one fused Triton kernel on CUDA, ``act_fn``
    elsewhere), chosen per call from ``config.kernel_backend``."""

    def __init__(self, config: KDAMoEConfig, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.config = config
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = GLUActivation(config.hidden_act, config.situ_beta, config.situ_linear_beta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [*, hidden_size]`` → ``[*, hidden_size]`` in x's dtype."""
        gate, up = fused_linear(x, (self.gate_proj, self.up_proj))
        h = glu_activation(gate, up, self.act_fn, backend=self.config.kernel_backend)
        return self.down_proj(h)


# ----------------------------------------------------------------------------------------------------
# Packed sequences: where a row restarts (TRL padding-free / our packed pretraining batches)
# ----------------------------------------------------------------------------------------------------
def packed_sequence_info(position_ids: torch.Tensor) -> dict:
    """Sequence layout of a packed ``[B, T]`` batch whose ``position_ids`` restart at 0 per document.

    Returns a dict with ``seq_idx [B, T]`` (global sequence id per token), ``cu_seqlens [N+1]`` int32
    over the flattened ``B*T`` tokens, and ``first_seq [B]`` / ``last_seq [B]`` (each row's first and last
    sequence id), used to seed and read back per-row recurrent states.
    """
    B, T = position_ids.shape
    starts = position_ids == 0
    starts[:, 0] = True
    seq_idx = starts.flatten().long().cumsum(0).view(B, T) - 1
    lengths = torch.bincount(seq_idx.flatten())
    cu_seqlens = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    return {"seq_idx": seq_idx, "cu_seqlens": cu_seqlens, "first_seq": seq_idx[:, 0], "last_seq": seq_idx[:, -1]}


# ----------------------------------------------------------------------------------------------------
# Token mixer 1: Kimi Delta Attention (the lower-bounded gate, or Kimi Linear's unbounded one)
# ----------------------------------------------------------------------------------------------------
@use_kernelized_func([causal_conv1d, causal_conv1d_parts, chunk_kda, fused_recurrent_kda])
class KDAMoEDeltaAttention(nn.Module):
    """KDA layer (Kimi Linear report §3; docs/architecture.md §1).

    ``q, k = L2Norm(SiLU(ShortConv(W x)))``, ``v = SiLU(ShortConv(W x))`` (one fused depthwise conv over
    q|k|v), ``β = σ(W_β x)``, the forget gate ``g = g_min·σ(exp(A_log)·(W_f2 W_f1 x + dt_bias))`` (or, with
    ``kda_lower_bound=None``, Kimi Linear's ``g = −exp(A_log)·softplus(W_f2 W_f1 x + dt_bias)``; ``A_log`` ``[H]``
    only with ``kda_use_A_log``, else scale 1) and output ``W_o(RMSNorm_head(o) ⊙ σ(W_g2 W_g1 x [+ b_g2]))`` (with
    ``kda_full_rank_output_gate``, Kimi K3's ``σ(W_g x)``, one bias-free ``g_proj [H·K, d]``). The ops
    come from ``kernel_dispatch`` (kdamoe kernels, fla or PyTorch); the gate is always handed over raw
    (``use_gate_in_kernel``) and computed by the op, inside the kernel where the backend can. Padded positions
    (``attention_mask == 0``) are zeroed before the conv and get ``β = 0`` and a raw gate input of
    :attr:`PAD_GATE_INPUT`, for which the gate is exactly 0 in float32 (see there), so they leave the recurrent
    state exactly unchanged on every backend.
    """

    # Padded positions get the raw gate input f = −1e4, for which both gates are exactly 0 in float32:
    # * bounded: σ(x) = 1 / (1 + exp(−x)) is exactly 0 once exp(−x) overflows float32 (x < −88.8), and here
    #   x = exp(A_log)·(−1e4 + dt_bias): that holds while exp(A_log)·(1e4 − dt_bias) > 88.8, e.g. for any
    #   dt_bias < 9900 with A_log ≥ 0 (no A_log, or its init log(U[1, 16]) ≥ 0, checked there by
    #   `check_pad_gate_exact`). A trained A_log below −4.7 would give padded positions a nonzero g: down to about
    #   −6.3 still small enough that exp(g) rounds to 1 in float32 (|g| < 3e-8), below that a real decay of the state.
    # * unbounded: softplus(x) = log1p(exp(x)) is exactly 0 once exp(x) underflows to 0 in float32 (x < −104), i.e.
    #   for any dt_bias < 9896 whatever A_log, since −exp(A_log)·0 = 0 for every finite A_log.
    # A finite value, not −inf, keeps the gate's backward free of 0·inf.
    PAD_GATE_INPUT = -1.0e4

    def __init__(self, config: KDAMoEConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.kda_num_heads
        self.head_dim = config.kda_head_dim
        self.lower_bound = config.kda_lower_bound
        self.conv_kernel_size = config.kda_short_conv_kernel_size
        width = self.num_heads * self.head_dim
        d = config.hidden_size

        self.q_proj = nn.Linear(d, width, bias=False)
        self.k_proj = nn.Linear(d, width, bias=False)
        self.v_proj = nn.Linear(d, width, bias=False)
        self.conv1d = nn.Conv1d(3 * width, 3 * width, self.conv_kernel_size, groups=3 * width, bias=False)
        self.f_a_proj = nn.Linear(d, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, width, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(width))
        # Optional per-head log scale of the gate (docs/architecture.md §1), float32 like dt_bias
        # (`_keep_in_fp32_modules_strict`); None means scale 1.
        self.A_log = nn.Parameter(torch.empty(self.num_heads)) if config.kda_use_A_log else None
        self.b_proj = nn.Linear(d, self.num_heads, bias=False)
        if config.kda_full_rank_output_gate:
            self.g_proj = nn.Linear(d, width, bias=False)
        else:
            self.g_a_proj = nn.Linear(d, self.head_dim, bias=False)
            self.g_b_proj = nn.Linear(self.head_dim, width, bias=config.kda_output_gate_bias)
        self.o_norm = KDAMoEGatedRMSNorm(self.head_dim, eps=config.rms_norm_eps, config=config)
        self.o_proj = nn.Linear(width, d, bias=False)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        packed: dict | None = None,
    ) -> torch.Tensor:
        B, T, _ = hidden_states.shape
        H, K = self.num_heads, self.head_dim
        backend = self.config.kernel_backend
        if attention_mask is not None:
            hidden_states = hidden_states * attention_mask[..., None].to(hidden_states.dtype)

        conv_state = recurrent_state = None
        if cache is not None:
            conv_state = cache.get_conv_state(self.layer_idx)
            recurrent_state = cache.get_recurrent_state(self.layer_idx)
            if torch.is_grad_enabled() and conv_state is not None:
                # The cache overwrites its state buffers in place after this layer (transformers keeps their address
                # for CUDA graphs); a forward that autograd records must keep the values it read (a few KB per row).
                conv_state = conv_state.clone()
                recurrent_state = recurrent_state.clone() if recurrent_state is not None else None

        full_rank_gate = self.config.kda_full_rank_output_gate
        qkv, f, beta, gate = fused_linear(
            hidden_states, ((self.q_proj, self.k_proj, self.v_proj), self.f_a_proj, self.b_proj,
                            self.g_proj if full_rank_gate else self.g_a_proj)
        )
        seq_idx = packed["seq_idx"] if packed is not None else None
        q, k, v, new_conv_state = self._short_conv(qkv, conv_state, seq_idx, cache is not None)
        q, k, v = (x.view(B, T, H, K) for x in (q, k, v))

        f = self.f_b_proj(f).view(B, T, H, K)  # raw gate input
        beta = torch.sigmoid(beta.float())
        if attention_mask is not None:
            pad = ~attention_mask.bool()
            f = f.masked_fill(pad[..., None, None], self.PAD_GATE_INPUT)
            beta = beta.masked_fill(pad[..., None], 0.0)

        kwargs = dict(
            output_final_state=cache is not None, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            A_log=self.A_log, dt_bias=self.dt_bias, lower_bound=self.lower_bound, backend=backend,
        )
        if packed is not None:
            o, final_state = self._packed(q, k, v, f, beta, recurrent_state, packed, **kwargs)
        elif T == 1 and recurrent_state is not None:
            o, final_state = fused_recurrent_kda(q, k, v, f, beta, initial_state=recurrent_state, **kwargs)
        else:
            o, final_state = chunk_kda(
                q, k, v, f, beta, initial_state=recurrent_state, chunk_size=self.config.kda_chunk_size, **kwargs
            )

        if cache is not None:
            cache.update_conv_state(new_conv_state, self.layer_idx, conv_kernel_size=self.conv_kernel_size)
            cache.update_recurrent_state(final_state.float(), self.layer_idx)

        gate = (gate if full_rank_gate else self.g_b_proj(gate)).view(B, T, H, K)
        o = self.o_norm(o, gate).reshape(B, T, H * K)
        return self.o_proj(o)

    def _short_conv(self, qkv, conv_state, seq_idx, output_final_state):
        """The depthwise conv + SiLU of q|k|v (``[B, T, 3·width]``, the q, k and v columns side by side) →
        ``(q, k, v, new_conv_state)``, each part ``[B, T, width]``, the state ``[B, 3·width, W]`` over the q|k|v
        channels as the cache keeps it (None unless ``output_final_state``).

        One op for the three parts (``causal_conv1d_parts``; the conv is depthwise, so each part only sees its own
        channels of the one weight). ``qkv`` is one column view of the fused projection's output (``fused_linear``
        groups the three projections), so with the kdamoe kernels a single forward launch reads it in place through
        its row stride and writes q, k and v as three contiguous tensors, as the KDA op wants them, and the backward
        (two launches, one sum of the dweight partials) takes their three gradients as they come and writes one
        ``[B, T, 3·width]`` gradient for that view, the one piece the split's backward concatenates for the three.
        Neither a copy of q|k|v nor of the outputs is made. Before, one op per part (three launches forward, six
        backward, three dweight sums); a single op over a concatenation of separate q, k, v would instead have
        copied q|k|v in, q, k and v out, and concatenated their gradients. fla and PyTorch run one conv over the
        columns and return column views; a decode step (one token on a cached state, no gradient) is the backend's
        single update launch.
        """
        ys, new_state = causal_conv1d_parts(qkv, self.conv1d.weight.squeeze(1), conv_state, seq_idx, parts=3,
                                            output_final_state=output_final_state, backend=self.config.kernel_backend)
        return (*ys, new_state)

    def _packed(self, q, k, v, f, beta, recurrent_state, packed, **kwargs):
        """Run every packed document as its own sequence (``cu_seqlens`` over the flattened batch)."""
        B, T, H, K = q.shape
        cu_seqlens = packed["cu_seqlens"]
        initial_state = None
        if recurrent_state is not None:
            # A cached row state continues only the row's first document; the others start from zero.
            initial_state = recurrent_state.new_zeros(cu_seqlens.numel() - 1, *recurrent_state.shape[1:])
            initial_state[packed["first_seq"]] = recurrent_state
        flat = [x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, f, beta)]
        o, final_state = chunk_kda(
            *flat, initial_state=initial_state, cu_seqlens=cu_seqlens, chunk_size=self.config.kda_chunk_size, **kwargs
        )
        if final_state is not None:
            final_state = final_state[packed["last_seq"]]
        return o.view(B, T, H, -1), final_state


# ----------------------------------------------------------------------------------------------------
# Token mixer 2: multi-head latent attention with no positional encoding
# ----------------------------------------------------------------------------------------------------
class KDAMoEAttention(nn.Module):
    """MLA with NoPE (DeepSeek-V2 §2.1 without rotating the decoupled key part; Kimi Linear report).

    ``q = W_q x`` (or ``W_qb RMSNorm(W_qa x)``), ``[c | k_shared] = W_dkv x`` with the latent ``c`` of width ``R =
    kv_lora_rank`` RMS-normed and the shared key part ``k_shared`` of width ``Dr = qk_rope_head_dim`` (0 by default)
    left as is; per head ``q = [q_nope | q_shared]`` (``Dn = qk_nope_head_dim`` then ``Dr`` columns),
    ``k = [W_uk c | k_shared]``, ``v = W_uv c`` (``W_uk``, ``W_uv`` fused as ``kv_b_proj``), causal softmax attention
    over ``qk_head_dim = Dn + Dr`` scaled by ``qk_head_dim^-1/2``. ``k_shared`` is the same for every head and, with
    no positional encoding, not rotated (transformers' ``KimiLinearAttention`` computes the same).

    Two exact ways to attend (docs/long-context.md):

    * **expanded** (prefill, training, long continuations): the keys and values of every visible token are expanded
      per head and attended with SDPA — a causal kernel aligned to the last query when a cache precedes the chunk, the
      mask from transformers' utilities when there is padding, packing or ``attn_implementation="eager"``;
    * **latent** (decoding, short continuations of a :class:`KDAMoECache`): with no positional encoding
      ``q·k_t = [W_uk^T q_nope | q_shared]·[c_t | k_shared,t]`` and ``Σ p_t v_t = W_uv (Σ p_t c_t)`` (DeepSeek-V2
      §2.1.2), so the query is absorbed into the cache's space of width ``R + Dr`` and the attention reads only the
      cached rows, its values being their first ``R`` columns (``kernel_dispatch.latent_attention``).

    With a :class:`KDAMoECache` the layer caches ``[c | k_shared]`` per token only; with a plain ``DynamicCache`` it
    caches per-head keys ``[B, H, S, qk_head_dim]`` and values as any transformers model.

    With ``mla_output_gate`` (Kimi K3) the attention output is gated per channel before ``o_proj``:
    ``o_proj(σ(g_proj x) ⊙ o)``, ``g_proj [H·v_head_dim, d]`` without bias, on both ways to attend.
    """

    def __init__(self, config: KDAMoEConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.qk_head_dim = config.qk_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.v_head_dim = config.v_head_dim
        self.num_key_value_groups = 1
        self.scaling = self.qk_head_dim**-0.5
        self.is_causal = True
        self.attention_dropout = 0.0
        d = config.hidden_size
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(d, self.num_heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, config.q_lora_rank, bias=False)
            self.q_a_layernorm = KDAMoERMSNorm(config.q_lora_rank, eps=config.mla_norm_eps, config=config)
            self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj = nn.Linear(d, config.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = KDAMoERMSNorm(config.kv_lora_rank, eps=config.mla_norm_eps, config=config)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim),
                                   bias=False)
        if config.mla_output_gate:
            self.g_proj = nn.Linear(d, self.num_heads * self.v_head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, d, bias=False)

    def _output(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """``o_proj`` of the attention output ``[B, T, H·v_head_dim]``, gated first by ``σ(gate)`` (same shape) when
        the layer has an output gate."""
        if gate is not None:
            out = out * torch.sigmoid(gate).to(out.dtype)
        return self.o_proj(out)

    def forward(self, hidden_states, masks: dict | None = None, cache: Cache | None = None, **kwargs):
        """``hidden_states [B, T, d]`` → ``([B, T, d], attention weights or None)``.

        ``masks`` (built by :class:`KDAMoEModel`): ``"full_attention"`` a 4-D mask or None (None = plain causal),
        ``"latent"`` whether to attend in the latent space, ``"key_mask"`` the ``[B, ≥ past+T]`` padding mask the
        latent path reads (or None).
        """
        masks = masks or {"full_attention": None, "latent": False, "key_mask": None}
        B, T, _ = hidden_states.shape
        R, Dr = self.config.kv_lora_rank, self.qk_rope_head_dim
        gate = None
        projections = (self.q_proj if self.config.q_lora_rank is None else self.q_a_proj, self.kv_a_proj)
        if self.config.mla_output_gate:
            q, compressed, gate = fused_linear(hidden_states, (*projections, self.g_proj))
        else:
            q, compressed = fused_linear(hidden_states, projections)
        if self.config.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(B, T, self.num_heads, self.qk_head_dim)
        if Dr:
            # per-token cache row [normed latent | k_shared] (only the latent is normed)
            rows = torch.cat([self.kv_a_layernorm(compressed[..., :R]), compressed[..., R:]], dim=-1)
        else:
            rows = self.kv_a_layernorm(compressed)  # [B, T, kv_lora_rank]
        layer_cache = cache.layers[self.layer_idx] if cache is not None else None
        if isinstance(layer_cache, KDAMoELatentCacheLayer):
            rows, _ = layer_cache.update(rows)  # every visible row, [B, past + T, R + Dr]
            if masks["latent"]:
                return self._latent_attention(q, layer_cache, masks["key_mask"], gate), None

        # split before the head transpose: the split's backward then concatenates dk | dv straight into the
        # projection's [B, T, H, Dn + Dv] layout (after the transpose it wrote [B, H, T, ·], copied once more back)
        latent = rows[..., :R] if Dr else rows
        kv = self.kv_b_proj(latent).view(B, -1, self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        k, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        if Dr:
            k_shared = rows[..., None, R:].expand(-1, -1, self.num_heads, -1)  # one part for every head
            k = torch.cat([k, k_shared.to(k.dtype)], dim=-1)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        if layer_cache is not None and not isinstance(layer_cache, KDAMoELatentCacheLayer):
            k, v = cache.update(k, v, self.layer_idx)  # a per-head DynamicCache passed by the user
        q = q.transpose(1, 2)
        mask = masks["full_attention"]
        if mask is None and self.config._attn_implementation == "sdpa":
            out, attn_weights = _causal_sdpa(q, k, v, self.scaling), None
        else:
            attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, eager_attention_forward
            )
            out, attn_weights = attention_interface(self, q, k, v, mask, scaling=self.scaling, dropout=0.0, **kwargs)
        return self._output(out.reshape(B, T, self.num_heads * self.v_head_dim), gate), attn_weights

    def _absorbed_weights(self, like: torch.Tensor) -> torch.Tensor:
        """``[R, H, qk_nope_head_dim + v_head_dim]``: ``kv_b_proj`` applied to the identity, i.e. its effective weight
        — also when PEFT wraps the projection (a LoRA delta is linear too)."""
        R = self.config.kv_lora_rank
        eye = torch.eye(R, dtype=like.dtype, device=like.device)
        return self.kv_b_proj(eye).view(R, self.num_heads, self.qk_nope_head_dim + self.v_head_dim)

    def _latent_attention(self, q, layer_cache, key_mask, gate=None) -> torch.Tensor:
        """Attention in the cache's space: ``q [B, T, H, qk_head_dim]`` → ``o_proj`` output ``[B, T, d]`` (gated by
        ``σ(gate)``, ``[B, T, H·v_head_dim]``, when the layer has an output gate).

        Per head ``h`` and cached row ``[c_s | k_shared,s]``: the score is ``q_nope,h·W_uk,h c_s + q_shared,h·k_shared,s
        = [W_uk,hᵀ q_nope,h | q_shared,h]·[c_s | k_shared,s]``, one dot product of width ``R + Dr`` with the absorbed
        query, and the output ``Σ_s p_hs W_uv,h c_s = W_uv,h (Σ_s p_hs [c_s | k_shared,s])[:R]``: the op returns the
        first ``R`` columns of the weighted row sum (``value_dim=R``)."""
        B, T = q.shape[:2]
        R = self.config.kv_lora_rank
        w = self._absorbed_weights(q)
        w_uk, w_uv = w[..., : self.qk_nope_head_dim], w[..., self.qk_nope_head_dim :]
        q_latent = torch.einsum("bthd,rhd->bthr", q[..., : self.qk_nope_head_dim], w_uk)
        if self.qk_rope_head_dim:
            q_latent = torch.cat([q_latent, q[..., self.qk_nope_head_dim :].to(q_latent.dtype)], dim=-1)
        seq_len = layer_cache.cache.past_length + T
        latents = layer_cache.latents  # under autocast the normed latent is float32 while q is not
        o_latent = latent_attention(
            q_latent.to(latents.dtype), latents, seq_len, self.scaling, key_mask, value_dim=R,
            backend=self.config.kernel_backend,
        )
        out = torch.einsum("bthr,rhv->bthv", o_latent.to(w_uv.dtype), w_uv)
        return self._output(out.reshape(B, T, self.num_heads * self.v_head_dim), gate)


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal SDPA of ``q [B, H, T, D]`` over ``k, v [B, H, S, D]`` (``S ≥ T``: the last ``T`` keys are the queries'
    own) with no mask tensor, so the fused kernels run. Returns ``[B, T, H, Dv]`` like transformers' attention
    functions.

    A chunk after a cache (``S > T > 1``) is split into its unmasked part over the ``S − T`` cached keys and its
    causal part over its own keys, merged by log-sum-exp (:func:`_prefix_then_causal`). Measured on an H200 (bf16,
    8 heads of 128, 512K tokens in 32K chunks, the whole prefill): 6.8 s with cuDNN's kernels merged this way, 8.6 s
    with FlashAttention-2's merged, 8.9 s as one call with a bottom-right causal mask (``causal_lower_right``, which
    torch runs on the memory-efficient kernel) — an earlier run of benchmarks/bench_long_context.py (git history of
    benchmarks/results/long_context_h200.md). cuDNN and the CPU's flash
    kernel return the log-sum-exp; float32 on CUDA (cuDNN takes half precision only) uses the masked single call.
    """
    T, S = q.shape[-2], k.shape[-2]
    if S == T:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, scale=scaling)
    elif T == 1:
        out = F.scaled_dot_product_attention(q, k, v, scale=scaling)
    elif q.is_cuda and q.dtype not in (torch.float16, torch.bfloat16):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(T, S), scale=scaling)
    else:
        out = _prefix_then_causal(q, k, v, scaling)
    return out.transpose(1, 2)


def _attention_with_lse(q, k, v, scaling: float, causal: bool):
    """``(out [B, H, T, Dv] in q.dtype, logsumexp [B, H, T] float32)``: cuDNN's fused attention on CUDA (half
    precision), the CPU's flash kernel elsewhere — the aten ops behind SDPA that also return the log-sum-exp.

    The CPU flash kernel refuses a value head dim other than the query/key one (``qk_rope_head_dim`` or
    ``v_head_dim`` make them differ; "Q/K/V should have the same head size"), so the narrower side is zero-padded to
    the wider: zero value columns give zero output columns (sliced off), zero query/key columns add nothing to a score
    (the scale is passed explicitly), so the result and the log-sum-exp are exact. cuDNN took 192 / 128 unpadded on
    an H100 (torch 2.11, bf16); it is padded too, since older cuDNN builds are not known to, at the cost of reading
    the padded values."""
    Dk, Dv = q.shape[-1], v.shape[-1]
    if Dv < Dk:
        v = F.pad(v, (0, Dk - Dv))
    elif Dk < Dv:
        q, k = F.pad(q, (0, Dv - Dk)), F.pad(k, (0, Dv - Dk))
    if q.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scaling
        )[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scaling)[:2]
    return out[..., :Dv], lse.reshape(q.shape[:3]).float()


def _prefix_then_causal(q, k, v, scaling: float) -> torch.Tensor:
    """Attention of a chunk ``q [B, H, T, D]`` over ``S − T`` cached keys (all visible) and its own ``T`` keys
    (causal): two fused calls on an unmasked and a square causal problem, merged by their log-sum-exps
    (``o = Σ_i e^{lse_i − m} o_i / Σ_i e^{lse_i − m}``, the split-softmax identity behind FlashAttention, Dao et al.
    2022, and flash-decoding)."""
    T, S = q.shape[-2], k.shape[-2]
    o_past, lse_past = _attention_with_lse(q, k[:, :, : S - T], v[:, :, : S - T], scaling, False)
    o_own, lse_own = _attention_with_lse(q, k[:, :, S - T :], v[:, :, S - T :], scaling, True)
    m = torch.maximum(lse_past, lse_own)
    w_past, w_own = torch.exp(lse_past - m).unsqueeze(-1), torch.exp(lse_own - m).unsqueeze(-1)
    out = (o_past.float() * w_past + o_own.float() * w_own) / (w_past + w_own)
    return out.to(q.dtype)


# ----------------------------------------------------------------------------------------------------
# Stable LatentMoE: sigmoid router with a balancing bias, latent experts, shared experts
# ----------------------------------------------------------------------------------------------------
# Optimizer steps taken in this process (torch's global post-step hook, registered by the first router that counts):
# a router that still holds statistics counted before a later optimizer step was not updated after that step.
_optimizer_steps = 0
_optimizer_step_hook = None
_warned_models: set[int] = set()  # id() of the configs warned about (configs are unhashable)


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


def _watch_optimizer_steps() -> None:
    global _optimizer_step_hook
    if _optimizer_step_hook is None:
        _optimizer_step_hook = register_optimizer_step_post_hook(_count_optimizer_step)


def _warn_biases_not_updated(config) -> None:
    """One warning per model when its routers counted tokens before an optimizer step and ``update_router_biases()``
    did not run after it: a plain ``transformers.Trainer`` / TRL trainer without the router-bias callback, or a
    hand-written loop that never calls the update, trains with frozen biases and no expert-load metrics."""
    if id(config) in _warned_models:
        return
    _warned_models.add(id(config))
    logger.warning(
        "KDAMoE router biases are not being updated: an optimizer step ran, but update_router_biases() was not "
        "called after it. With transformers' Trainer or a TRL trainer call "
        "kdamoe.callbacks.add_router_bias_callback(trainer) before train(); in a hand-written loop call "
        "model.update_router_biases() after each optimizer.step(). (config.router_bias_update='none' turns the "
        "updates off on purpose.)"
    )


def _inside_backward() -> bool:
    """True while autograd runs a backward pass (activation-checkpoint recomputation happens there)."""
    return torch._C._current_graph_task_id() != -1


class KDAMoETopkRouter(nn.Module):
    """Sigmoid router with a selection-only bias, Top-(k+1) and the Quantile Balancing statistics.

    ``s = σ(W_r x)``, ``T = TopK(s + b, k)``, ``p_j = s_j / Σ_{r∈T} s_r``; the Top-(k+1) biased scores give
    the selection margins QB histograms (see ``quantile_balancing.selection_margins``). One op computes all of
    it: ``kernel_dispatch.moe_route_op`` picks the Triton kernel on CUDA and ``moe_torch.moe_route_torch``
    otherwise (the same function). ``e_score_correction_bias`` (the bias ``b``) is a saved buffer that is never trained;
    it changes only in :meth:`update_bias`. The statistics are plain tensors (not buffers) so they are
    neither saved nor broadcast by DDP.
    """

    def __init__(self, config: KDAMoEConfig):
        super().__init__()
        self.config = config
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts, dtype=torch.float32))
        # With a latent the weights are scaled only on request (Kimi K3 does; kdamoe's own models never did).
        scaled = config.moe_latent_size is None or config.latent_moe_routed_scaling
        self.scaling = config.routed_scaling_factor if scaled else 1.0
        self.reset_statistics()

    def reset_statistics(self):
        """Forget the tokens counted since the last bias update. Once allocated, the statistics are zeroed in place, so
        a captured training step (``train_graph.TrainStepGraph``) keeps counting into the tensors Python reads."""
        self._counting_since = None  # the optimizer step count when counting began (see _check_updated)
        if getattr(self, "tokens_per_expert", None) is not None:
            self.tokens_per_expert.zero_()
            self.qb_counts.zero_()
            return
        self.qb_counts = None  # [E, qb_num_bins] float64 histogram of r = α − s
        self.tokens_per_expert = None  # [E] float64

    def forward(self, hidden_states: torch.Tensor, token_mask: torch.Tensor | None = None):
        """Route ``hidden_states [N, d]``; ``token_mask [N]`` (bool) excludes padding from the statistics.

        Returns ``(router_logits [N, E] float32, top_k_index [N, k] int64, top_k_weights [N, k] float32)``.
        The statistics are gathered only in training mode with grad enabled, and not again while an
        activation checkpoint recomputes the layer inside backward.
        """
        with torch.autocast(device_type=hidden_states.device.type, enabled=False):
            router_logits = F.linear(hidden_states.float(), self.weight.float())
        record = self.training and torch.is_grad_enabled() and not _inside_backward()
        quantile = record and self.config.router_bias_update == "quantile"
        route = moe_route_op(self.config.kernel_backend, router_logits.device)
        # .float(): a blanket model.to(torch.bfloat16) casts this buffer too; both ops take it as float32
        top_k_index, top_k_weights, tokens_per_expert, qb_counts = route(
            router_logits, self.e_score_correction_bias.float(), self.top_k, self.scaling,
            token_mask=token_mask if record else None, count_tokens=record,
            num_bins=self.config.qb_num_bins if quantile else None,
        )
        if record:
            self._accumulate(tokens_per_expert, qb_counts)
            self._check_updated()
        return router_logits, top_k_index, top_k_weights

    def _check_updated(self) -> None:
        """Note the optimizer step at which counting began; warn (once per model) when a later step has run without
        an update (:func:`_warn_biases_not_updated`). Only for biases that training would move: a router weight that
        requires grad and ``router_bias_update != "none"``."""
        if self.config.router_bias_update == "none" or not self.weight.requires_grad:
            return
        _watch_optimizer_steps()
        if self._counting_since is None:
            self._counting_since = _optimizer_steps
        elif _optimizer_steps > self._counting_since:
            _warn_biases_not_updated(self.config)

    @torch.no_grad()
    def _accumulate(self, tokens_per_expert, qb_counts):
        if self.tokens_per_expert is not None and self.tokens_per_expert.device != tokens_per_expert.device:
            # plain tensors, which a model.to() does not move (and reset_statistics keeps them once allocated)
            self.tokens_per_expert = self.tokens_per_expert.to(tokens_per_expert.device)
            self.qb_counts = self.qb_counts.to(tokens_per_expert.device)
        if self.tokens_per_expert is None:
            self.tokens_per_expert = torch.zeros_like(tokens_per_expert)
            self.qb_counts = torch.zeros(self.num_experts, self.config.qb_num_bins, dtype=torch.float64,
                                         device=tokens_per_expert.device)
        self.tokens_per_expert += tokens_per_expert
        if qb_counts is not None:
            self.qb_counts += qb_counts

    def expert_load(self) -> torch.Tensor:
        """``[E]`` float32 tokens routed to each expert since the last update (zeros if none)."""
        if self.tokens_per_expert is None:
            return torch.zeros(self.num_experts, device=self.e_score_correction_bias.device)
        return self.tokens_per_expert.float()

    def statistics(self) -> torch.Tensor:
        """``[E + E·qb_num_bins]`` float64: the token counts then the QB histogram gathered since the last update
        (zeros when nothing was counted, so every rank contributes the same shape to the all-reduce)."""
        E, bins = self.num_experts, self.config.qb_num_bins
        flat = torch.zeros(E + E * bins, dtype=torch.float64, device=self.e_score_correction_bias.device)
        if self.tokens_per_expert is not None:
            flat[:E] = self.tokens_per_expert
            flat[E:] = self.qb_counts.flatten()
        return flat

    @torch.no_grad()
    def update_bias(self, statistics: torch.Tensor | None = None) -> None:
        """Apply the configured bias rule, then reset the statistics.

        ``statistics`` are :meth:`statistics` summed over the data-parallel ranks (what
        :meth:`KDAMoEPreTrainedModel.update_router_biases` passes); None sums this router's own with one
        all-reduce. Every rank then computes the same bias.
        """
        rule = self.config.router_bias_update
        if statistics is None and rule != "none":
            statistics = all_reduce_sum(self.statistics())
        if rule != "none":
            E = self.num_experts
            load, counts = statistics[:E], statistics[E:].view(E, self.config.qb_num_bins)
            bias = self.e_score_correction_bias
            if rule == "quantile":
                lo, hi = histogram_range(bias)
                if counts.sum() > 0:
                    bias.copy_(quantile_balancing_update(counts, lo, hi, self.top_k).to(bias.dtype))
            elif load.sum() > 0:
                bias.copy_(sign_update(bias, load, self.config.router_bias_update_rate))
        self.reset_statistics()


# Implementations of transformers' experts interface that read SiTU-GLU through ``_apply_gate`` (they split
# the fused ``gate_up`` output and call the module's gate function); the others fuse their own activation.
EXPERTS_IMPLEMENTATIONS_WITH_SITU = ("eager", "kdamoe", "grouped_mm", "batched_mm")


def kdamoe_experts_forward(self, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
    """The ``"kdamoe"`` experts implementation: the fused Triton grouped-GEMM kernel of ``kdamoe.kernels`` on
    CUDA (SiTU-GLU in its epilogue), the per-expert PyTorch loop elsewhere (``config.kernel_backend`` decides,
    see ``kernel_dispatch``). Shapes as :meth:`KDAMoEExperts.forward`."""
    op = moe_experts_op(self.config.kernel_backend, hidden_states.device)
    return op(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj, self.act_fn)


ALL_EXPERTS_FUNCTIONS.register("kdamoe", kdamoe_experts_forward)


@use_experts_implementation
class KDAMoEExperts(nn.Module):
    """Routed experts as fused 3-D weights (transformers' layout), run in the latent width ``ℓ``.

    ``gate_up_proj [E, 2I, ℓ]`` (gate rows first, then up rows), ``down_proj [E, ℓ, I]``;
    ``forward(hidden_states [N, ℓ], top_k_index [N, k], top_k_weights [N, k]) -> [N, ℓ]``; index
    ``== num_experts`` is skipped (tokens owned by another expert-parallel rank).

    Dispatched through transformers' experts interface (``config._experts_implementation``, set by
    ``from_pretrained(..., experts_implementation=...)`` or ``model.set_experts_implementation``):
    ``"kdamoe"`` (default, :func:`kdamoe_experts_forward`), ``"eager"`` (this class's own forward, the
    per-expert loop) and transformers' ``"grouped_mm"`` / ``"batched_mm"``, which compute SiTU-GLU correctly
    because they call :meth:`_apply_gate`. Implementations that fuse their own activation are refused
    when ``hidden_act="situ"`` (:meth:`KDAMoEPreTrainedModel.get_correct_experts_implementation`).
    """

    def __init__(self, config: KDAMoEConfig, in_features: int):
        super().__init__()
        self.config = config
        self.num_experts = config.num_experts
        self.intermediate_dim = config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_dim, in_features))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, in_features, self.intermediate_dim))
        self.act_fn = GLUActivation(config.hidden_act, config.situ_beta, config.situ_linear_beta)

    def _apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
        """``act(gate, up)`` of a fused ``[S, 2I]`` gate/up output (gate columns first): SiTU-GLU caps both
        branches, so transformers' default ``act(gate) * up`` would drop the linear branch's ``β2`` cap."""
        gate, up = gate_up_out.chunk(2, dim=-1)
        return self.act_fn(gate, up)

    def forward(self, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        return moe_experts_torch(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                                 self.act_fn)


class KDAMoESparseMoeBlock(nn.Module):
    """Stable LatentMoE (LatentMoE arXiv:2601.18089; Kimi K3 report §2.3; docs/architecture.md §3).

    ``y = shared(x) + W_up RMSNorm(Σ_{j∈T} p_j E_j(W_down x))``; router, ``W_down`` and shared experts
    all read the pre-normed ``x``. With ``moe_latent_size=None`` the experts run at full width and
    ``y = shared(x) + Σ p_j E_j(x)`` (``p`` scaled by ``routed_scaling_factor``).
    """

    def __init__(self, config: KDAMoEConfig):
        super().__init__()
        d, latent = config.hidden_size, config.moe_latent_size
        self.gate = KDAMoETopkRouter(config)
        self.experts = KDAMoEExperts(config, latent if latent is not None else d)
        if latent is not None:
            self.latent_down_proj = nn.Linear(d, latent, bias=False)
            self.latent_norm = KDAMoERMSNorm(latent, eps=config.rms_norm_eps, config=config)
            self.latent_up_proj = nn.Linear(latent, d, bias=False)
        self.shared_experts = None
        if config.num_shared_experts > 0:
            self.shared_experts = KDAMoEMLP(config, d, config.moe_intermediate_size * config.num_shared_experts)

    def forward(self, hidden_states: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden_states [B, T, d]`` (pre-normed) → ``[B, T, d]``; ``token_mask [B·T]`` excludes padding
        from the balancing statistics. Router logits are recorded from the router (``output_router_logits``)."""
        B, T, d = hidden_states.shape
        x = hidden_states.reshape(-1, d)
        _, top_k_index, top_k_weights = self.gate(x, token_mask)
        if hasattr(self, "latent_down_proj"):
            routed = self.experts(self.latent_down_proj(x), top_k_index, top_k_weights)
            routed = self.latent_up_proj(self.latent_norm(routed))
        else:
            routed = self.experts(x, top_k_index, top_k_weights)
        if self.shared_experts is not None:
            routed = routed + self.shared_experts(x)
        return routed.view(B, T, d)


# ----------------------------------------------------------------------------------------------------
# Block Attention Residuals
# ----------------------------------------------------------------------------------------------------
class KDAMoEBlockAttnRes(nn.Module):
    """Softmax-over-depth mix of residual sources (Attention Residuals, arXiv:2603.15031, Block AttnRes).

    ``h = Σ_i softmax_i(w · RMSNorm(v_i)) v_i`` with a zero-initialised pseudo-query ``w`` (so training
    starts from the uniform average) and its own key RMSNorm (``key_norm`` holds its weight and eps; the norm is
    fused into the mix). ``kernel_dispatch.block_attnres`` runs it: on CUDA one Triton kernel that reads the
    sources in place, elsewhere ``attnres_torch``; chosen per call from ``config.kernel_backend``.
    """

    def __init__(self, config: KDAMoEConfig):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(config.hidden_size))
        self.key_norm = KDAMoERMSNorm(config.hidden_size, eps=config.rms_norm_eps, config=config)

    def forward(self, sources: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> torch.Tensor:
        """``S`` sources ``[B, T, d]`` (a list / tuple, never stacked) → mixed ``[B, T, d]`` (softmax in float32)."""
        return block_attnres(sources, self.query, self.key_norm.weight, self.key_norm.variance_epsilon,
                             backend=self.key_norm.kernel_backend)


def _sources(block_states: tuple[torch.Tensor, ...], partial: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """Finished block sums plus the current partial sum (if any sublayer of the block has run): a tuple of the
    same tensors, no copy."""
    return block_states if partial is None else (*block_states, partial)


# ----------------------------------------------------------------------------------------------------
# Decoder layer
# ----------------------------------------------------------------------------------------------------
class KDAMoEDecoderLayer(GradientCheckpointingLayer):
    """Token mixer (KDA or MLA) then MLP (dense or MoE), each with its pre-norm.

    Standard residual stream (``attnres_num_blocks == 0``): ``forward(hidden_states)`` returns the
    updated stream. Block AttnRes: ``forward(partial, *block_states)`` mixes each sublayer's input over
    the sources and returns the updated partial block sum. The finished block sums come as positional tensors
    (not one stacked tensor, not a list) so that no copy is made and a reentrant gradient checkpoint, which
    tracks positional tensors only, still differentiates through them.
    """

    def __init__(self, config: KDAMoEConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.self_attn = KDAMoEDeltaAttention(config, layer_idx)
        else:
            self.self_attn = KDAMoEAttention(config, layer_idx)
        self.is_sparse = config.mlp_layer_types[layer_idx] == "sparse"
        if self.is_sparse:
            self.mlp = KDAMoESparseMoeBlock(config)
        else:
            self.mlp = KDAMoEMLP(config, config.hidden_size, config.intermediate_size)
        self.input_layernorm = KDAMoERMSNorm(config.hidden_size, eps=config.rms_norm_eps, config=config)
        self.post_attention_layernorm = KDAMoERMSNorm(config.hidden_size, eps=config.rms_norm_eps, config=config)
        self.use_attnres = config.attnres_num_blocks > 0
        if self.use_attnres:
            self.attn_res = KDAMoEBlockAttnRes(config)
            self.mlp_res = KDAMoEBlockAttnRes(config)

    def _mix(self, hidden_states, attention_mask, cache, packed, **kwargs):
        if self.layer_type == "linear_attention":
            return self.self_attn(hidden_states, attention_mask["linear_attention"], cache, packed)
        out, _ = self.self_attn(hidden_states, attention_mask, cache, **kwargs)
        return out

    def _mlp(self, hidden_states, token_mask):
        if self.is_sparse:
            return self.mlp(hidden_states, token_mask)
        return self.mlp(hidden_states)

    def forward(
        self,
        hidden_states: torch.Tensor | None,
        *block_states: torch.Tensor,
        attention_mask: dict | None = None,
        cache: Cache | None = None,
        packed: dict | None = None,
        token_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        attention_mask = attention_mask or {"linear_attention": None, "full_attention": None, "latent": False,
                                            "key_mask": None}
        if not self.use_attnres:
            mixed = self._mix(self.input_layernorm(hidden_states), attention_mask, cache, packed, **kwargs)
            hidden_states, normed = self.post_attention_layernorm(mixed, hidden_states)  # the residual add, fused
            return hidden_states + self._mlp(normed, token_mask)

        partial = hidden_states
        h = self.attn_res(_sources(block_states, partial))
        mixed = self._mix(self.input_layernorm(h), attention_mask, cache, packed, **kwargs)
        partial = mixed if partial is None else partial + mixed
        h = self.mlp_res(_sources(block_states, partial))
        return partial + self._mlp(self.post_attention_layernorm(h), token_mask)


# ----------------------------------------------------------------------------------------------------
# Pretrained model, backbone, heads
# ----------------------------------------------------------------------------------------------------
def _fsdp2_wrapped_class(model: nn.Module) -> type | None:
    """The class FSDP2's ``fully_shard`` wrapped, i.e. the base of the ``FSDP<Name>`` class it gave ``model``, or
    None when ``model`` is not an FSDP2 module."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415 (torch.distributed.fsdp is absent on torch builds without torch.distributed)

    if not isinstance(model, FSDPModule):
        return None
    return next(cls for cls in type(model).__bases__ if not issubclass(cls, FSDPModule))


# The `auto_map` of a saved folder: every KDAMoE head, so a folder saved from the causal LM also loads as `AutoModel`
# or `AutoModelForSequenceClassification` (reward / value models) with `trust_remote_code=True`.
AUTO_MAP = {
    "AutoConfig": "configuration_kdamoe.KDAMoEConfig",
    "AutoModel": "modeling_kdamoe.KDAMoEModel",
    "AutoModelForCausalLM": "modeling_kdamoe.KDAMoEForCausalLM",
    "AutoModelForSequenceClassification": "modeling_kdamoe.KDAMoEForSequenceClassification",
}


class KDAMoEPreTrainedModel(PreTrainedModel):
    """Weight init, Quantile Balancing lifecycle and transformers plumbing shared by all heads."""

    config_class = KDAMoEConfig
    config: KDAMoEConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["KDAMoEDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    _is_stateful = True
    _keep_in_fp32_modules_strict = ["e_score_correction_bias", "dt_bias", "A_log"]
    # transformers' output recorder: router logits (raw ``[B·T, E]`` float32, one per MoE layer) and, with the
    # eager attention implementation, the MLA layers' attention weights. Hidden states are collected by the
    # model itself (with Block AttnRes the residual stream is not a layer's output).
    _can_record_outputs = {
        "router_logits": OutputRecorder(KDAMoETopkRouter, index=0),
        "attentions": OutputRecorder(KDAMoEAttention, index=1),
    }

    def __init__(self, config: KDAMoEConfig, *inputs, **kwargs):
        # Checked again here: `from_pretrained(..., situ_beta=...)` / `AutoConfig` keyword overrides and attributes
        # set after construction reach the config without passing through `KDAMoEConfig.__init__`.
        config.validate_kdamoe()
        super().__init__(config, *inputs, **kwargs)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """transformers' ``from_pretrained``, with Hub kernels left off unless the caller asks for them
        (:func:`.kernel_dispatch.hub_kernels_off_by_default` says why).

        A folder or Hub id whose ``config.json`` says ``model_type: kimi_linear`` (Moonshot's Kimi Linear releases,
        or transformers' ``KimiLinearForCausalLM.save_pretrained``) is loaded through the weight map of
        :mod:`.kimi_linear_format` (:func:`~.kimi_linear_format.from_kimi_linear_pretrained`): strictly (a missing,
        extra or wrongly shaped tensor is a ``ValueError`` naming it), with ``router_bias_update="none"`` unless the
        caller passes another rule, taking ``dtype`` / ``torch_dtype``, ``device_map=None`` and the Hub arguments.
        A ``model_type: kimi_k3`` folder (Kimi K3's released layout, MXFP4 experts) loads its text model the same way
        through :mod:`.kimi_k3_format` (:func:`~.kimi_k3_format.from_kimi_k3_pretrained`).

        Raises:
            ValueError: the folder's ``config.json`` names another ``model_type`` (or none), naming it; and what the
                Kimi loaders raise.
        """
        kwargs = hub_kernels_off_by_default(kwargs)
        pretrained = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        if kwargs.get("config") is None and kwargs.get("state_dict") is None and len(args) <= 1:
            kimi = read_config_dict(pretrained, kwargs)
            if is_kimi_linear_config(kimi):
                kwargs.pop("pretrained_model_name_or_path", None)
                return from_kimi_linear_pretrained(cls, pretrained, kimi, kwargs)
            if is_kimi_k3_config(kimi):
                kwargs.pop("pretrained_model_name_or_path", None)
                return from_kimi_k3_pretrained(cls, pretrained, kimi, kwargs)
            own = cls.config_class.model_type
            if kimi is not None and (not isinstance(kimi, dict) or kimi.get("model_type") != own):
                # transformers only warns about another model type and then fails inside its config code (an
                # AttributeError for a multimodal config's text_config dict), naming neither the folder nor the type
                found = (f"config.json's model_type is {kimi.get('model_type')!r}" if isinstance(kimi, dict) else
                         f"config.json holds {type(kimi).__name__} {str(kimi)[:40]!r}, not a JSON object")
                raise ValueError(f"{pretrained}: {found}; {cls.__name__} loads {own!r} folders and Moonshot's "
                                 "'kimi_linear' and 'kimi_k3' checkpoints")
        return super().from_pretrained(*args, **kwargs)

    def get_correct_experts_implementation(self, requested_experts: str | None) -> str:
        """transformers' choice of experts implementation, defaulting to ``"kdamoe"``; refuses (``ValueError``)
        the implementations that fuse an activation of their own when ``hidden_act="situ"``."""
        implementation = super().get_correct_experts_implementation(requested_experts or "kdamoe")
        if self.config.hidden_act == "situ" and implementation not in EXPERTS_IMPLEMENTATIONS_WITH_SITU:
            raise ValueError(
                f"experts_implementation={implementation!r} cannot compute SiTU-GLU (hidden_act='situ'): it fuses "
                f"its own activation; use one of {EXPERTS_IMPLEMENTATIONS_WITH_SITU}"
            )
        return implementation

    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, KDAMoEDeltaAttention):
            if module.A_log is not None:
                init.copy_(module.A_log, _A_log_init(module.A_log))
            init.copy_(module.dt_bias, _dt_bias_init(module.dt_bias, self.config.kda_lower_bound, module.A_log))
        elif isinstance(module, KDAMoEExperts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, KDAMoETopkRouter):
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, KDAMoEBlockAttnRes):
            init.zeros_(module.query)
            init.ones_(module.key_norm.weight)
        elif isinstance(module, KDAMoERMSNorm):
            init.ones_(module.weight)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """``PreTrainedModel.save_pretrained``, with ``auto_map`` naming every KDAMoE head.

        transformers writes only the saved class's entry; listing all of them lets a folder saved from
        the causal LM load as ``AutoModel`` or ``AutoModelForSequenceClassification`` (reward / value
        models) with ``trust_remote_code=True``.

        A model sharded by FSDP2 (``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=...))``)
        is saved from every rank: rank 0 writes the gathered weights and this package's code, not torch's FSDP
        files that transformers would otherwise take for the model's code (docs/distributed.md).
        """
        self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}), **AUTO_MAP}
        own_class = _fsdp2_wrapped_class(self)
        if own_class is None:
            return super().save_pretrained(save_directory, *args, **kwargs)
        # FSDP2's `fully_shard` (`DistributedConfig(fsdp_size=...)`) swaps the model's class for a generated
        # `FSDP<Name>(FSDPModule, <Name>)` defined in torch: transformers would copy torch's FSDP files as the remote
        # code and point `auto_map` at the generated class. Copy the wrapped class's code instead (the saving rank
        # only, as transformers does) and keep the `auto_map` set above: the generated class alone stops being
        # "remote code" for the call.
        if self.should_save_on_this_rank(kwargs.get("is_main_process", True)):
            os.makedirs(save_directory, exist_ok=True)
            custom_object_save(own_class, save_directory)
        type(self)._auto_class = None
        try:
            return super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            del type(self)._auto_class

    def _routers(self) -> list[KDAMoETopkRouter]:
        return [m for m in self.modules() if isinstance(m, KDAMoETopkRouter)]

    def expert_load(self) -> torch.Tensor:
        """``[num_sparse_layers, num_experts]`` float32 tokens routed per expert since the last update.

        Counted in training forwards only (training mode, grad enabled, padding excluded, never twice
        under activation checkpointing); this rank's counts (not summed across ranks).
        """
        routers = self._routers()
        if not routers:
            return torch.zeros(0, self.config.num_experts)
        return torch.stack([r.expert_load() for r in routers])

    def update_router_biases(self) -> None:
        """Apply ``config.router_bias_update`` once: call after each optimizer step (not per forward).

        Uses everything counted since the previous call (so gradient accumulation is handled), sums the
        statistics across data-parallel ranks, updates every router's ``e_score_correction_bias`` and
        resets the counts. Eval / inference forwards never count, so they never move the biases.

        Frozen routers (no router weight requires grad: a PEFT adapter on this model, a frozen reference model)
        keep their biases: the counts are reset and nothing moves, with one ``logger.warning`` per model — the
        rule :class:`kdamoe.callbacks.RouterBiasUpdateCallback` applies. A PEFT adapter saves no buffers, so
        moved biases would make the saved adapter rebuild another model on the published base
        (docs/pretraining.md, "Router biases under PEFT"). Every data-parallel rank holds the same
        ``requires_grad`` flags, so all of them skip the all-reduce together.
        """
        routers = self._routers()
        frozen = bool(routers) and not any(router.weight.requires_grad for router in routers)
        if frozen and self.config.router_bias_update != "none" and not getattr(self, "_frozen_bias_warned", False):
            self._frozen_bias_warned = True
            logger.warning(f"update_router_biases() on {type(self).__name__} leaves its router biases frozen: no "
                           "router weight requires grad (PEFT adapter or frozen model), and a PEFT adapter saves no "
                           "buffers; statistics are still reset on every call.")
        if not routers or self.config.router_bias_update == "none" or frozen:
            for router in routers:
                router.reset_statistics()
            return
        # One all-reduce for every router's counts and histogram (docs/architecture.md §4): a rank that counted
        # nothing still takes part (zeros), so no rank waits on a collective the others skipped.
        device = routers[0].e_score_correction_bias.device  # (routers may sit on several devices)
        stats = all_reduce_sum(torch.stack([router.statistics().to(device) for router in routers]))
        for router, own in zip(routers, stats, strict=True):
            router.update_bias(own.to(router.e_score_correction_bias.device))


# Range of exp(A_log) at init, fla's for Kimi Linear: A_log = log(U[1, 16]).
A_LOG_INIT_RANGE = (1.0, 16.0)


def _A_log_init(A_log: torch.Tensor) -> torch.Tensor:
    """``A_log [H]`` drawn as ``log(U[1, 16])`` (fla's init for Kimi Linear), in A_log's dtype and device; checked
    against :func:`check_pad_gate_exact` (``A_log ≥ 0`` always passes)."""
    value = torch.empty(A_log.shape, dtype=torch.float32).uniform_(*A_LOG_INIT_RANGE).log()
    check_pad_gate_exact(value)
    return value.to(A_log.device, A_log.dtype)


def check_pad_gate_exact(A_log: torch.Tensor, max_dt_bias: float = 100.0) -> None:
    """``ValueError`` unless the bounded gate of a padded position (raw input ``PAD_GATE_INPUT``) is exactly 0 in
    float32 for every head of ``A_log`` (CPU tensor ``[H]``) and every ``dt_bias ≤ max_dt_bias``:
    ``exp(A_log)·(−PAD_GATE_INPUT − max_dt_bias) > 88.8``, where ``exp(−x)`` overflows and ``σ(x)`` is 0. The
    unbounded gate needs no such condition (``KDAMoEDeltaAttention.PAD_GATE_INPUT`` says why)."""
    margin = -KDAMoEDeltaAttention.PAD_GATE_INPUT - max_dt_bias
    smallest = float(A_log.detach().float().min()) if A_log.numel() else 0.0
    if math.exp(smallest) * margin <= 88.8:
        raise ValueError(f"A_log has a value {smallest:.3g} for which a padded position's bounded gate "
                         f"σ(exp(A_log)·({KDAMoEDeltaAttention.PAD_GATE_INPUT:g} + dt_bias)) is not exactly 0 in "
                         f"float32 (needs exp(A_log)·{margin:g} > 88.8, i.e. A_log > {math.log(88.8 / margin):.3g})")


def _dt_bias_init(dt_bias: torch.Tensor, lower_bound: float | None, A_log: torch.Tensor | None = None) -> torch.Tensor:
    """``dt_bias [H·K]`` for the gate's form (docs/architecture.md §1), in dt_bias's dtype and device.

    * bounded (``lower_bound`` a float): at zero input ``exp(g)`` is log-uniform over [0.9, 0.999]:
      ``g = lower_bound · σ(exp(A_log_h) · dt_bias)`` ⇒ ``dt_bias = logit(g / lower_bound) / exp(A_log_h)`` with
      ``g ~ U[ln 0.9, ln 0.999]`` (``exp(A_log_h) = 1`` without A_log);
    * unbounded (None): Kimi Linear's (fla's) init, ``dt_bias = softplus⁻¹(dt)`` with ``dt`` log-uniform over
      [1e-3, 0.1] (at least 1e-4), so that ``−softplus(dt_bias) = −dt`` at zero input before the A_log scale.
    """
    if lower_bound is None:
        dt = torch.empty(dt_bias.shape, dtype=torch.float32).uniform_(math.log(1e-3), math.log(1e-1)).exp()
        dt = dt.clamp_min(1e-4)
        # softplus⁻¹(y) = y + log(1 − exp(−y)), written with expm1 to stay exact for small y.
        return (dt + torch.log(-torch.expm1(-dt))).to(dt_bias.device, dt_bias.dtype)
    g = torch.empty(dt_bias.shape, dtype=torch.float32).uniform_(math.log(0.9), math.log(0.999))
    value = torch.logit(g / lower_bound)
    if A_log is not None and A_log.device.type != "meta":
        value = (value.view(A_log.shape[0], -1) * torch.exp(-A_log.detach().float().cpu())[:, None]).flatten()
    return value.to(dt_bias.device, dt_bias.dtype)


def packed_causal_mask_function(doc_ids: torch.Tensor) -> Callable:
    """An ``and_mask_function`` for transformers' ``create_causal_mask``: a query sees a key only if both belong
    to the same packed document.

    ``doc_ids [B, past + T]`` holds the document id of every key position (cached keys belong to the row's first
    document). The mask utilities call it with absolute query / key positions, so it also holds when a packed
    batch continues a cache — the case transformers' own packed-sequence detection skips (it runs only without
    a cache).
    """

    def same_document(batch_idx, head_idx, q_idx, kv_idx):
        return doc_ids[batch_idx, kv_idx] == doc_ids[batch_idx, q_idx]

    return same_document


# Continuations of a KDAMoECache up to this many tokens per row attend in the latent space (decode steps, short
# tool-result turns); longer ones expand keys / values per head, where SDPA's fused kernels win (the latent path costs
# (R + R) / (qk + v) = 2x the FLOPs of the expanded one for the preset's R = 256, qk = v = 128).
LATENT_ATTENTION_MAX_TOKENS = 64


def _last_document_start(packed: dict, past: int) -> int:
    """Key position (cached tokens included) where every row's last packed document starts.

    A ``[B, H, L, D]`` attention cache can continue one document per row only if those documents start at the
    same position in every row. Raises ``ValueError`` otherwise (pass ``use_cache=False`` for such batches).
    """
    seq_idx, last_seq = packed["seq_idx"], packed["last_seq"]
    first_of_last = (seq_idx == last_seq[:, None]).int().argmax(-1)  # [B] index of the last document's first token
    starts = torch.where(seq_idx[:, 0] == last_seq, 0, first_of_last + past)  # a one-document row keeps its past
    start = int(starts[0])
    if bool((starts != start).any()):
        raise ValueError(
            f"a cache after a packed batch continues each row's last document, which must start at the same position "
            f"in every row (they start at {starts.tolist()}); pass use_cache=False for packed batches"
        )
    return start


class KDAMoEModel(KDAMoEPreTrainedModel):
    """The decoder stack: embeddings, layers, (final AttnRes mix), final norm."""

    def __init__(self, config: KDAMoEConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([KDAMoEDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        if config.attnres_num_blocks > 0:
            self.final_res = KDAMoEBlockAttnRes(config)
        self.norm = KDAMoERMSNorm(config.hidden_size, eps=config.rms_norm_eps, config=config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        past_key_values: Cache | None = None,
        prefill_chunk_size: int | None = None,
        loss_targets: torch.Tensor | None = None,
        **kwargs,
    ) -> MoeModelOutputWithPast:
        """Run the stack. Inputs ``input_ids [B, T]`` (or ``inputs_embeds [B, T, d]``), optional 2-D
        ``attention_mask [B, past+T]`` (1 = token, 0 = padding) and ``position_ids [B, T]`` (restarts at 0
        mark packed documents when no mask is given; honoured with or without a cache). ``use_cache``
        defaults to ``config.use_cache`` except in a training forward (training mode with grad enabled),
        which builds no cache; the cache built is a :class:`KDAMoECache` (latent-only MLA layers).
        ``prefill_chunk_size`` (default ``config.prefill_chunk_size``; 0 = off): a forward without grad longer
        than this runs in chunks of that many tokens, with the same result (docs/long-context.md); packed inputs
        and forwards with grad always run in one pass (autograd keeps every chunk's activations anyway).
        ``loss_targets``: the class ids a loss on this output will read (the CausalLM passes its shifted labels), whose
        range is checked in the same host sync as the inputs, with the ``ignore_index`` keyword (default −100) exempt.

        Returns ``last_hidden_state [B, T, d]``, the ``cache`` and, when asked, ``router_logits`` (tuple of
        ``[B·T, E]`` float32, one per MoE layer), ``attentions`` (eager attention only: one ``[B, H, T, past+T]``
        per MLA layer; KDA layers have no attention matrix) and ``hidden_states`` (``L + 1`` tensors ``[B, T, d]``:
        the embeddings, the residual stream after each layer — with Block AttnRes the sum of the embeddings and
        every sublayer output so far — and, last, the final normed state equal to ``last_hidden_state``).

        Raises:
            ValueError: for malformed inputs (see :func:`validate_model_inputs`), a bad ``prefill_chunk_size``,
                ``output_attentions=True`` with an attention implementation that returns no weights, or router
                logits / attention weights asked of a chunked forward.
        """
        cache = cache if cache is not None else past_key_values
        want_router = kwargs.pop("output_router_logits", None)  # recorded by capture_outputs
        want_router = self.config.output_router_logits if want_router is None else want_router
        want_attentions = kwargs.pop("output_attentions", self.config.output_attentions)
        if want_attentions and self.config._attn_implementation != "eager":
            raise ValueError(
                f"output_attentions=True needs attn_implementation='eager' (got {self.config._attn_implementation!r}, "
                "which returns no weights); only the MLA layers have attention weights"
            )
        if use_cache is None:
            use_cache = self.config.use_cache and not (self.training and torch.is_grad_enabled())
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            use_cache = False
        if not use_cache:
            cache = None
        has_full_attention = "full_attention" in self.config.layer_types
        managed = isinstance(cache, KDAMoECache) and cache.step_managed  # a DecodeGraph capturing this step
        # Only attention layers count cached tokens; without one the cache cannot tell (None; NoPE needs no
        # position, so only the mask-length check is relaxed).
        past = 0
        if cache is not None:
            past = attention_seq_length(cache) if has_full_attention else None
        tokens = input_ids if input_ids is not None else inputs_embeds  # validated below: one of them is given
        facts = {}
        # a DecodeGraph / TrainStepGraph validates the real inputs before each replay (and the check's host read could
        # not run while a graph is captured)
        if not managed and not inputs_are_prevalidated():
            facts = validate_model_inputs(self.config, input_ids, inputs_embeds, attention_mask, position_ids, past,
                                          loss_targets, kwargs.get("ignore_index", -100))
            if cache is not None:
                check_cache_matches(self.config, cache, tokens.shape[0])
        past = past or 0
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        chunk = self.config.prefill_chunk_size if prefill_chunk_size is None else prefill_chunk_size
        check_prefill_chunk_size(chunk)
        B, T = tokens.shape[:2]
        if position_ids is None:  # consecutive from `past`: no restart, nothing to read back
            position_ids = torch.arange(past, past + T, device=tokens.device).unsqueeze(0)
            facts["position_restarts"] = False
        position_ids = position_ids.expand(B, T)
        mask_4d = attention_mask is not None and attention_mask.dim() == 4  # a custom mask, passed through as is
        if attention_mask is not None and not mask_4d and not managed and T > 1 and facts.get("mask_all_ones", False):
            attention_mask = None  # no padding: the plain causal kernels apply (and restarts mark packed documents)
        if attention_mask is not None and not mask_4d and facts.get("restarts_between_tokens"):
            raise ValueError(
                "position_ids restart at 0 between real tokens (packed documents) while attention_mask pads the batch: "
                "packed documents are separated only without padding; pass padding-free packed rows without an "
                "attention_mask (TRL's padding_free), or consecutive position_ids with the padding mask"
            )
        restarts = facts.get("position_restarts")
        packed = attention_mask is None and T > 1 and (
            restarts if restarts is not None else bool((position_ids[:, 1:] == 0).any()))
        chunked = bool(chunk) and T > chunk and not packed and not mask_4d and not torch.is_grad_enabled()
        if chunked and (want_router or want_attentions):
            raise ValueError(
                f"router logits and attention weights are not collected by a chunked forward ({T} tokens > "
                f"prefill_chunk_size={chunk}); pass prefill_chunk_size=0 to run it in one pass"
            )
        if use_cache and cache is None:
            cache = KDAMoECache(self.config)
        run_cache = cache if cache is not None or not chunked else KDAMoECache(self.config)  # carries the chunks

        if not chunked:
            hidden_states, all_hidden_states = self._forward_tokens(
                input_ids, inputs_embeds, attention_mask, position_ids, run_cache, past, packed, output_hidden_states,
                kwargs,
            )
        else:
            hidden_states, per_chunk = None, []
            for start in range(0, T, chunk):
                end = min(T, start + chunk)
                ids = input_ids[:, start:end] if input_ids is not None else None
                embeds = inputs_embeds[:, start:end] if inputs_embeds is not None else None
                mask = attention_mask[:, : past + end] if attention_mask is not None else None
                out, states = self._forward_tokens(
                    ids, embeds, mask, position_ids[:, start:end], run_cache, past + start, False,
                    output_hidden_states, kwargs,
                )
                if hidden_states is None:
                    hidden_states = out.new_empty(B, T, out.shape[-1])
                hidden_states[:, start:end] = out
                per_chunk.append(states)
            all_hidden_states = [torch.cat(layer_states, 1) for layer_states in zip(*per_chunk, strict=True)]

        hidden_states_out = None
        if output_hidden_states:
            hidden_states_out = tuple(all_hidden_states[:-1]) + (hidden_states,)
        return MoeModelOutputWithPast(last_hidden_state=hidden_states, cache=cache, hidden_states=hidden_states_out)

    def _forward_tokens(self, input_ids, inputs_embeds, attention_mask, position_ids, cache, past, packed,
                        output_hidden_states, kwargs):
        """One pass of the stack over ``T`` tokens per row after ``past`` cached ones; returns ``(normed hidden
        states [B, T, d], the per-layer hidden states or [])``. ``attention_mask`` is None (no padding) or 2-D."""
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        B, T, _ = inputs_embeds.shape
        packed = packed_sequence_info(position_ids) if packed else None
        latent_cache = isinstance(cache, KDAMoECache)
        managed = latent_cache and cache.step_managed
        mask_2d = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
        if mask_2d is not None and mask_2d.dtype.is_floating_point:
            mask_2d = mask_2d != 0  # the latent kernel reads an integer / bool padding mask
        if latent_cache and not managed:
            cache.begin_forward(T, inputs_embeds.device)

        masks = {
            "linear_attention": create_recurrent_attention_mask(self.config, inputs_embeds, attention_mask, cache),
            "full_attention": None,
            # Short continuations of a latent cache attend in the latent space (reads R values per cached token
            # instead of H·(qk + v)); the kernel takes the 2-D padding mask itself.
            "latent": latent_cache and T <= LATENT_ATTENTION_MAX_TOKENS and packed is None
            and self.config._attn_implementation != "eager" and (attention_mask is None or mask_2d is not None),
            "key_mask": kwargs.get("latent_key_mask", mask_2d),
        }
        if "full_attention" in self.config.layer_types and not masks["latent"] and (
            attention_mask is not None or packed is not None or self.config._attn_implementation != "sdpa"
        ):
            same_document = None
            if packed is not None:
                doc_ids = packed["seq_idx"]
                if past:
                    doc_ids = torch.cat([packed["first_seq"][:, None].expand(B, past), doc_ids], 1)
                same_document = packed_causal_mask_function(doc_ids)
            masks["full_attention"] = create_causal_mask(
                config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask, cache=cache,
                and_mask_function=same_document,
            )
        token_mask = None
        if mask_2d is not None:
            token_mask = mask_2d[:, -T:].reshape(-1).bool()
        keep_from = None
        if packed is not None and cache is not None and "full_attention" in self.config.layer_types:
            keep_from = _last_document_start(packed, past)

        layer_kwargs = dict(attention_mask=masks, cache=cache, packed=packed, token_mask=token_mask)
        all_hidden_states = [inputs_embeds] if output_hidden_states else []
        if self.config.attnres_num_blocks == 0:
            hidden_states = inputs_embeds
            for layer in self.layers:
                hidden_states = layer(hidden_states, **layer_kwargs)
                if output_hidden_states:
                    all_hidden_states.append(hidden_states)
        else:
            blocks, partial = [inputs_embeds], None
            block_size = self.config.attnres_block_size
            for i, layer in enumerate(self.layers):
                partial = layer(partial, *blocks, **layer_kwargs)
                if output_hidden_states:
                    all_hidden_states.append(sum(blocks) + partial)
                if (i + 1) % block_size == 0 or i == len(self.layers) - 1:
                    blocks.append(partial)
                    partial = None
            hidden_states = self.final_res(blocks)

        if latent_cache and not managed:
            cache.end_forward(T)
        if keep_from:
            # A cache continues each row's last document only (the KDA and conv states already are that
            # document's); drop the earlier documents' keys/values so later steps cannot attend to them.
            for i, layer_type in enumerate(self.config.layer_types):
                if layer_type != "full_attention":
                    continue
                if isinstance(cache.layers[i], KDAMoELatentCacheLayer):
                    cache.layers[i].drop_first(keep_from)
                else:
                    cache.layers[i].keys = cache.layers[i].keys[:, :, keep_from:]
                    cache.layers[i].values = cache.layers[i].values[:, :, keep_from:]
        return self.norm(hidden_states), all_hidden_states


# The keyword arguments transformers' ForCausalLMLoss reads; a forward passing any other keyword calls
# `self.loss_function` itself (it would receive the keyword, whatever it does with it).
_CAUSAL_LM_LOSS_KWARGS = frozenset(("num_items_in_batch", "ignore_index", "shift_labels"))


class KDAMoEForCausalLM(KDAMoEPreTrainedModel, GenerationMixin):
    """KDAMoE with a language-modelling head; ``MoeCausalLMOutputWithPast`` out, ``generate()`` ready."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    # FSDP2 (`DistributedConfig(fsdp_size=...)`): with the config's `norm` rule, the final norm and the head form one
    # group that stays gathered from the forward into the backward (the last thing forward runs, the first backward).
    _fsdp_plan = {"lm_head": "keep_full_weight"}

    def __init__(self, config: KDAMoEConfig):
        super().__init__(config)
        self.model = KDAMoEModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
        if self.generation_config is not None:
            # transformers copies config fields named like generation fields; `prefill_chunk_size` would switch on
            # generate()'s own chunked prefill (which needs a cache and ids). The forward chunks by the config.
            self.generation_config.prefill_chunk_size = None

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_router_logits: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> MoeCausalLMOutputWithPast:
        """Causal LM forward. ``labels [B, T]`` (−100 = ignore) are shifted inside, as in every transformers
        CausalLM. ``logits_to_keep``: an int keeps the last n positions (0 = all), a tensor selects them.
        With ``output_router_logits`` and ``router_aux_loss_coef > 0``, the softmax load-balancing aux
        loss (Switch Transformer) is added to the loss.

        The loss is ``self.loss_function``'s. When that is transformers' ``ForCausalLMLoss`` (the default: no other
        ``loss_type`` or ``loss_function`` set), it runs through ``kernel_dispatch.causal_lm_loss`` with the three
        keywords ``ForCausalLMLoss`` reads (``num_items_in_batch``, ``ignore_index``, ``shift_labels``; it ignores
        any other): the fused Triton
        cross-entropy on the kernel backend (the bf16 logits read in place, no float32 copy; same result), else
        ``ForCausalLMLoss`` itself. Its targets are then range-checked in the input check's one host sync: a target
        outside ``[0, vocab_size)`` other than ``ignore_index`` raises ``ValueError``.
        """
        output_router_logits = (
            output_router_logits if output_router_logits is not None else self.config.output_router_logits
        )
        cache = cache if cache is not None else past_key_values
        graph_step = self._decode_graph_step(input_ids, inputs_embeds, attention_mask, cache, labels, use_cache,
                                             output_router_logits, logits_to_keep, kwargs)
        if graph_step == "replay":
            logits = self._graph_decode(input_ids, attention_mask, cache)
            if logits is not None:
                return MoeCausalLMOutputWithPast(logits=logits, cache=cache)
        # ForCausalLMLoss reads these three keywords and ignores the rest (the packing collator's, output flags), so
        # the fused path takes the same three whatever else came
        if "loss_targets" in kwargs:
            raise ValueError("loss_targets is set by KDAMoEForCausalLM.forward from labels / shift_labels; pass those")
        causal_lm_loss_call = labels is not None and self.loss_function is ForCausalLMLoss
        loss_targets = None  # what the loss will read, checked by the backbone's input check (no second host sync)
        if causal_lm_loss_call:
            loss_targets = kwargs.get("shift_labels")
            if loss_targets is None and isinstance(labels, torch.Tensor) and labels.dim() > 0:
                loss_targets = labels[..., 1:]  # the first label is never a target
        with _capture_stream(cache) if graph_step == "warm_up" else contextlib.nullcontext():
            outputs = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                inputs_embeds=inputs_embeds,
                use_cache=use_cache,
                output_router_logits=output_router_logits,
                loss_targets=loss_targets,
                **kwargs,
            )
        new_tokens = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        if isinstance(outputs.cache, KDAMoECache) and new_tokens == 1:
            outputs.cache.decode_steps += 1
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])

        loss = aux_loss = None
        if causal_lm_loss_call:
            loss_kwargs = {key: kwargs[key] for key in _CAUSAL_LM_LOSS_KWARGS if key in kwargs}
            loss = causal_lm_loss(logits, labels, self.config.vocab_size, **loss_kwargs,
                                  backend=self.config.kernel_backend)
        elif labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        if output_router_logits and outputs.router_logits:
            aux_loss = load_balancing_loss_func(
                outputs.router_logits, self.config.num_experts, self.config.num_experts_per_tok, attention_mask
            )
            if loss is not None and self.config.router_aux_loss_coef > 0:
                loss = loss + self.config.router_aux_loss_coef * aux_loss.to(loss.device)
        return MoeCausalLMOutputWithPast(
            loss=loss, aux_loss=aux_loss, logits=logits, cache=outputs.cache, hidden_states=outputs.hidden_states,
            attentions=outputs.attentions, router_logits=outputs.router_logits,
        )

    # ------------------------------------------------------------------------------------------------
    # Decoding: the latent cache for generate(), and one-token steps replayed from a CUDA graph
    # ------------------------------------------------------------------------------------------------
    def generate(self, *args, **kwargs):
        """``GenerationMixin.generate``, refusing speculative decoding first (``ValueError``): assisted generation
        (``assistant_model``, ``assistant_early_exit``) and prompt lookup (``prompt_lookup_num_tokens``) roll the cache
        back to the last accepted draft token, and the KDA layers' recurrent state cannot be rewound. transformers
        5.24 refuses stateful models with its own message and 5.25 fails inside its past-recording call; this gives
        one message on every version."""
        config = kwargs.get("generation_config") or self.generation_config
        asked = [name for name in ("assistant_model", "assistant_early_exit", "prompt_lookup_num_tokens")
                 if kwargs.get(name) is not None or getattr(config, name, None) is not None]
        if asked:
            raise ValueError(
                f"{asked[0]}: assisted generation and prompt lookup are not supported by KDAMoE models: they rewind "
                "the cache to the last accepted draft token, and the KDA layers' recurrent state cannot be rewound; "
                "generate without them"
            )
        return super().generate(*args, **kwargs)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length):
        """``generate()`` builds a :class:`KDAMoECache` preallocated to its ``max_length`` unless the user passed a
        cache or asked for another ``cache_implementation`` (then transformers decides, as for any model).

        Also the earliest point where ``generate(prefill_chunk_size=...)`` (transformers' own chunked prefill, which
        splits the prompt before calling the forward) can be checked: a value it cannot split by raises here.
        """
        chunk = generation_config.prefill_chunk_size
        check_prefill_chunk_size(chunk)
        if chunk == 0:  # transformers splits the prompt by it; the forward's own chunking is what 0 turns off
            raise ValueError("generate(prefill_chunk_size=0) cannot split the prompt; pass None, or set "
                             "`model.config.prefill_chunk_size = 0` to turn the forward's chunking off")
        if (model_kwargs.get("cache") is None and generation_config.use_cache is not False
                and generation_config.cache_implementation in (None, "dynamic")):
            model_kwargs["cache"] = KDAMoECache(self.config, max_cache_len=max_cache_length)
            return
        return super()._prepare_cache_for_generation(
            generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
        )

    def _decode_graph_step(self, input_ids, inputs_embeds, attention_mask, cache, labels, use_cache,
                           output_router_logits, logits_to_keep, kwargs) -> str | None:
        """``"replay"`` for a one-token inference step that a CUDA graph can replay, ``"warm_up"`` for the first
        such step on the cache (run eagerly on the capture stream), None for anything else (runs eagerly)."""
        if not (self.config.decode_cuda_graphs and isinstance(cache, KDAMoECache) and not cache.graphs_disabled
                and input_ids is not None
                and inputs_embeds is None and input_ids.dim() == 2 and input_ids.shape[1] == 1 and input_ids.is_cuda):
            return None
        if self.training or torch.is_grad_enabled() or labels is not None or use_cache is False or output_router_logits:
            return None
        if kwargs.get("output_attentions") or kwargs.get("output_hidden_states") or self.config.output_hidden_states:
            return None
        if attention_mask is not None and attention_mask.dim() != 2:
            return None
        if not isinstance(logits_to_keep, int) or logits_to_keep not in (0, 1) or getattr(self, "_hf_hook", None):
            return None
        if torch.cuda.is_current_stream_capturing() or torch.compiler.is_compiling():
            return None
        if not decode_graphs_supported(self.config.kernel_backend, input_ids.device,
                                       bounded_gate=self.config.kda_lower_bound is not None):
            return None
        if cache.decode_steps == 0:
            return "warm_up"
        past = cache.get_seq_length() if cache.latent_layers else 0
        return "replay" if all(layer.capacity > past for layer in cache.latent_layers) else None

    def _graph_decode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, cache: KDAMoECache):
        """Validate the ids (one host sync, before the replay), capture the step if needed, replay it."""
        past = cache.get_seq_length() if cache.latent_layers else None
        validate_model_inputs(self.config, input_ids, None, attention_mask, None, past)
        key = (input_ids.shape[0], attention_mask is not None)
        graph = cache.graphs.get(key)
        if graph is not None and not graph.valid_for(self):
            cache.drop_graphs()
            graph = None
        if graph is None:
            try:
                with _capture_stream(cache):
                    graph = cache.graphs[key] = DecodeGraph(self, cache, *key)
            except RuntimeError as error:  # an op that cannot be captured: say so once, decode eagerly
                logger.warning_once(f"decode step capture failed ({error}); decoding without CUDA graphs on this cache")
                cache.graphs_disabled = True
                return None
        cache.decode_steps += 1
        return graph.replay(input_ids, attention_mask)

    def _decode_step(self, input_ids: torch.Tensor, cache: KDAMoECache, key_mask: torch.Tensor | None):
        """The function a :class:`DecodeGraph` captures: the ordinary forward of one token, logits ``[B, 1, V]``."""
        out = self.model(input_ids=input_ids, cache=cache, use_cache=True, latent_key_mask=key_mask)
        return self.lm_head(out.last_hidden_state)


@contextlib.contextmanager
def _capture_stream(cache: KDAMoECache):
    """Run on the cache's side stream, the one its graphs are captured on (PyTorch's recommended warm-up: the first
    step's lazy initialisations — cuBLAS workspaces, Triton autotuning — then happen on the capture stream)."""
    if cache.capture_stream is None:
        cache.capture_stream = torch.cuda.Stream()
    stream = cache.capture_stream
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        yield
    stream.synchronize()


class KDAMoEForSequenceClassification(KDAMoEPreTrainedModel):
    """KDAMoE with a linear ``score`` head read at each row's last non-padding token (reward / value models).

    Not transformers' ``GenericForSequenceClassification``: that head finds the last token by
    ``input_ids != pad_token_id``, which misreads rows whose real tokens include the pad id (TRL commonly sets
    ``pad_token = eos_token``) and needs ``input_ids``; this one reads the ``attention_mask`` when there is one.
    """

    def __init__(self, config: KDAMoEConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = KDAMoEModel(config)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> SequenceClassifierOutputWithPast:
        """Scores ``[B, num_labels]`` at the last token that is not padding (by ``attention_mask``, else by
        ``pad_token_id``, else the last position); loss by ``config.problem_type`` as in transformers."""
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            cache=cache if cache is not None else past_key_values, inputs_embeds=inputs_embeds,
            use_cache=use_cache, **kwargs,
        )
        logits = self.score(outputs.last_hidden_state)  # [B, T, labels]
        B, T = logits.shape[:2]
        if attention_mask is not None and attention_mask.dim() == 2:
            positions = torch.arange(T, device=logits.device)
            last = (attention_mask[:, -T:].to(logits.device).bool() * positions).argmax(-1)
        elif input_ids is not None and self.config.pad_token_id is not None:
            non_pad = (input_ids != self.config.pad_token_id).int() * torch.arange(T, device=logits.device)
            last = non_pad.argmax(-1)
        else:
            last = torch.full((B,), T - 1, device=logits.device)
        pooled = logits[torch.arange(B, device=logits.device), last]
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, pooled_logits=pooled, config=self.config)
        return SequenceClassifierOutputWithPast(
            loss=loss, logits=pooled, cache=outputs.cache, hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


__all__ = [
    "KDAMoEPreTrainedModel",
    "KDAMoEModel",
    "KDAMoEForCausalLM",
    "KDAMoEForSequenceClassification",
]
