"""Configuration of the KDA + MLA + Stable LatentMoE hybrid (model_type ``"kda_moe"``)."""

import difflib
import inspect
import math

from transformers.configuration_utils import PreTrainedConfig
from transformers.utils import logging

logger = logging.get_logger(__name__)

LAYER_TYPES = ("linear_attention", "full_attention")
MLP_LAYER_TYPES = ("dense", "sparse")
ROUTER_BIAS_UPDATES = ("quantile", "sign", "none")
HIDDEN_ACTS = ("situ", "silu")
KERNEL_BACKENDS = ("auto", "triton", "fla", "torch")
# Head dims the GPU kernels (ours and fla's) take: powers of two in [16, 256].
KERNEL_HEAD_DIMS = (16, 32, 64, 128, 256)


class KDAMoEConfig(PreTrainedConfig):
    r"""
    Configuration for [`KDAMoEModel`] / [`KDAMoEForCausalLM`]. The defaults give a small model that
    trains on a CPU; the architecture is described in docs/architecture.md (Kimi Linear report; Kimi K3 report
    §2.3; LatentMoE, arXiv:2601.18089; Attention Residuals, arXiv:2603.15031).

    Args:
        vocab_size (`int`, defaults to 4096): number of token ids.
        hidden_size (`int`, defaults to 256): width `d` of the residual stream.
        num_hidden_layers (`int`, defaults to 4): number of decoder layers.
        layer_types (`list[str]`, *optional*): per layer, `"linear_attention"` (KDA) or
            `"full_attention"` (MLA with no positional encoding). Default: every 4th layer is full
            attention (3:1 KDA:MLA), counting from 1.
        num_attention_heads (`int`, defaults to 4): MLA heads.
        kv_lora_rank (`int`, defaults to 128): width of the MLA latent `c = RMSNorm(W_dkv x)`.
        q_lora_rank (`int`, *optional*): rank of the MLA query (`None`: `q = W_q x`).
        qk_head_dim (`int`, *optional*): total MLA query/key head dim (per-head part plus the shared key part);
            `None` → `hidden_size // num_attention_heads`. Scaling `qk_head_dim^-1/2`.
        qk_rope_head_dim (`int`, defaults to 0): width `Dr` of the key part shared by every head (Kimi Linear /
            DeepSeek-V2 name; with no positional encoding it is *not* rotated): `kv_a_proj` outputs
            `kv_lora_rank + Dr` (latent first; only the latent is RMS-normed) and per head
            `q = [q_nope | q_shared]`, `k = [W_uk c | k_shared]`. Must be smaller than `qk_head_dim`; the per-head part
            `qk_nope_head_dim = qk_head_dim − qk_rope_head_dim` is what `kv_b_proj` produces (a property; a
            `qk_nope_head_dim` keyword, as Kimi Linear configs carry, sets `qk_head_dim` when that is not given).
        v_head_dim (`int`, *optional*): MLA value head dim; `None` → `qk_head_dim`.
        mla_rms_norm_eps (`float`, *optional*): epsilon of the MLA `q_a_layernorm` / `kv_a_layernorm`; `None` →
            `rms_norm_eps` (transformers' Kimi Linear uses 1e-6 there).
        mla_output_gate (`bool`, defaults to False): gate the MLA output per channel before `o_proj`:
            `o_proj(σ(g_proj x) ⊙ attn)` with `g_proj [num_attention_heads·v_head_dim, hidden_size]`, no bias (Kimi
            K3's `mla_use_output_gate`).
        kda_num_heads (`int`, defaults to 4): KDA heads.
        kda_head_dim (`int`, *optional*): KDA key = value head dim; `None` → `hidden_size // kda_num_heads`.
        kda_short_conv_kernel_size (`int`, defaults to 4): width of the depthwise causal conv on q, k, v.
        kda_lower_bound (`float` or None, defaults to -5.0): the KDA forget gate (docs/architecture.md §1). A float
            `g_min` gives the lower-bounded gate `g = g_min·σ(exp(A_log)·(f + dt_bias)) ∈ [g_min, 0)` and must satisfy
            `-5 ≤ kda_lower_bound < 0`: the chunked kernels anchor 16-token sub-chunks, so the largest gate exponent
            is `15·|g_min|` and has to stay well below `ln(FLT_MAX) ≈ 88.7` (15·5 = 75); a non-negative bound would
            not decay at all. `None` gives Kimi Linear's unbounded gate `g = −exp(A_log)·softplus(f + dt_bias)`
            (fla's `lower_bound=None`), which the Triton chunk kernel cannot take (`kernel_backend="triton"` is then
            refused; `"auto"` runs fla's KDA ops on CUDA when fla imports, else PyTorch).
        kda_use_A_log (`bool`, defaults to False): give every KDA layer a float32 parameter `A_log [kda_num_heads]`
            (init `log(U[1, 16])`, fla's) whose `exp` scales the gate per head; False means scale 1.
        kda_output_gate_bias (`bool`, defaults to True): whether `g_b_proj`, the second projection of the low-rank KDA
            output gate, has a bias (Kimi Linear's has none).
        kda_full_rank_output_gate (`bool`, defaults to False): the KDA output gate is one full-rank projection
            `g_proj [kda_num_heads·kda_head_dim, hidden_size]` with no bias (Kimi K3's `use_full_rank_gate`) instead
            of the low-rank `g_b_proj(g_a_proj x)`; `kda_output_gate_bias` is then not read.
        kda_chunk_size (`int`, defaults to 32): chunk length of the pure-PyTorch chunked KDA path (memory
            `O(T·chunk·K)` per head; 16 is faster on small CPU models). The Triton kernels use their own.
        num_experts (`int`, defaults to 16): routed experts per MoE layer.
        num_experts_per_tok (`int`, defaults to 2): experts per token `k`; Quantile Balancing reads the
            (k+1)-th score, so `k < num_experts`.
        num_shared_experts (`int`, defaults to 1): always-on experts at full width.
        moe_intermediate_size (`int`, defaults to 256): intermediate width `I` of each expert.
        moe_latent_size (`int`, *optional*, defaults to 128): latent width `ℓ` the routed experts run in;
            `None` → plain MoE at full width (then `routed_scaling_factor` scales the routed sum).
        first_k_dense_replace (`int`, defaults to 1): the first `k` layers use a dense MLP instead of MoE (read only
            when `mlp_layer_types` is None).
        mlp_layer_types (`list[str]`, *optional*): per layer `"dense"` (MLP of width `intermediate_size`) or
            `"sparse"` (Stable LatentMoE), in any order (transformers' Kimi Linear name); `None` → the first
            `first_k_dense_replace` layers dense, the rest sparse. Stored as the resolved list.
        intermediate_size (`int`, defaults to 512): width of the dense MLP.
        routed_scaling_factor (`float`, defaults to 1.0): multiplies the gate weights (without a latent; with one only
            when `latent_moe_routed_scaling`).
        latent_moe_routed_scaling (`bool`, defaults to False): with `moe_latent_size` set, multiply the gate weights by
            `routed_scaling_factor` too, before the latent RMSNorm (Kimi K3 / NeMo do; the norm makes it matter only
            through its eps). False keeps the weights as renormalised.
        router_bias_update (`str`, defaults to `"quantile"`): `"quantile"` (Quantile Balancing), `"sign"`
            (DeepSeek-V3 loss-free rule `b_j += u·sign(mean − load_j)`) or `"none"`.
        router_bias_update_rate (`float`, defaults to 1e-3): `u` of the `"sign"` rule.
        qb_num_bins (`int`, defaults to 1024): histogram bins per expert for the QB quantile.
        hidden_act (`str`, defaults to `"situ"`): `"situ"` (SiTU-GLU) or `"silu"` (SwiGLU), for routed,
            shared and dense MLPs alike.
        situ_beta (`float`, defaults to 4.0): `β1`, soft cap of the gated SiTU branch.
        situ_linear_beta (`float`, defaults to 25.0): `β2`, soft cap of the linear branch.
        attnres_num_blocks (`int`, defaults to 2): number `N` of Block Attention Residual blocks over the
            layers (block size `ceil(L/N)` layers); `0` → the standard residual stream.
        rms_norm_eps (`float`, defaults to 1e-6): epsilon of every RMSNorm.
        max_position_embeddings (`int`, defaults to 4096): longest context the model is meant for (NoPE:
            no table depends on it; generation utilities and TRL's tool loop read it).
        initializer_range (`float`, defaults to 0.02): std of the normal weight init.
        tie_word_embeddings (`bool`, defaults to False): share input embeddings and LM head.
        output_router_logits (`bool`, defaults to False): return per-layer router logits.
        router_aux_loss_coef (`float`, defaults to 0.0): weight of the optional softmax load-balancing
            aux loss (keep 0 with Quantile Balancing).
        kernel_backend (`str`, defaults to `"auto"`): `"auto"` (on CUDA: `kdamoe.kernels` when it imports,
            else flash-linear-attention when installed, else PyTorch; PyTorch on every other device),
            `"triton"`, `"fla"` or `"torch"` to force one. Any backend but `"torch"` needs `kda_head_dim` in
            {16, 32, 64, 128, 256}.
        use_cache (`bool`, defaults to True): return the cache from forward.
        prefill_chunk_size (`int` or None, defaults to 32768): an inference forward (no grad) longer than this
            many tokens per row runs in chunks of this length, carrying the KDA / conv states and the MLA latent
            cache between them, so activation memory is bounded by the chunk (docs/long-context.md); `0` or
            None runs every forward in one pass. `forward(..., prefill_chunk_size=...)` overrides it per call.
        decode_cuda_graphs (`bool`, defaults to True): one-token decode steps on CUDA with the Triton kernels
            and a `KDAMoECache` replay a captured CUDA graph (the first step on a cache runs eagerly as warm-up);
            False runs every step eagerly.

    Raises:
        ValueError: naming the field, for a bad `layer_types` / `mlp_layer_types` (naming the entry),
            `qk_rope_head_dim`, `mla_rms_norm_eps`, `num_experts_per_tok`, `kda_lower_bound` (also
            None with `kernel_backend="triton"`), non-boolean `kda_use_A_log` / `kda_output_gate_bias` /
            `kda_full_rank_output_gate` / `mla_output_gate` / `latent_moe_routed_scaling`,
            non-finite or non-positive SiTU betas / `rms_norm_eps` / scales, `attnres_num_blocks`, head sizes
            (a `kda_head_dim` the GPU kernels cannot take) or enum values.
    """

    model_type = "kda_moe"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]
    # Expert parallelism plan read by transformers' DistributedConfig (`ep_size`; docs/distributed.md): every rank
    # holds `num_experts / ep_size` whole experts (dim 0 of the 3-D weights) and the routed tokens travel to them by
    # all-to-all; the router, attention and shared experts stay replicated.
    base_model_ep_plan = {
        "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
        "layers.*.mlp.experts.down_proj": "grouped_gemm",
        "layers.*.mlp.experts": "ep_dispatch_experts",
    }
    # FSDP2 plan (`fsdp_size`): one `fully_shard` group per decoder layer (gathered for its forward, freed after,
    # gathered again for its backward) and the embeddings; the final norm stays gathered with the head
    # (`KDAMoEForCausalLM._fsdp_plan`). The Block AttnRes final mix (`final_res`) falls to the root group.
    base_model_fsdp_plan = {
        "embed_tokens": "free_full_weight",
        "layers.*": "free_full_weight",
        "norm": "keep_full_weight",
    }

    def __init__(
        self,
        vocab_size=4096,
        hidden_size=256,
        num_hidden_layers=4,
        layer_types=None,
        num_attention_heads=4,
        kv_lora_rank=128,
        q_lora_rank=None,
        qk_head_dim=None,
        v_head_dim=None,
        qk_rope_head_dim=0,
        mla_rms_norm_eps=None,
        mla_output_gate=False,
        kda_num_heads=4,
        kda_head_dim=None,
        kda_short_conv_kernel_size=4,
        kda_lower_bound=-5.0,
        kda_use_A_log=False,
        kda_output_gate_bias=True,
        kda_full_rank_output_gate=False,
        kda_chunk_size=32,
        num_experts=16,
        num_experts_per_tok=2,
        num_shared_experts=1,
        moe_intermediate_size=256,
        moe_latent_size=128,
        first_k_dense_replace=1,
        mlp_layer_types=None,
        intermediate_size=512,
        routed_scaling_factor=1.0,
        latent_moe_routed_scaling=False,
        router_bias_update="quantile",
        router_bias_update_rate=1e-3,
        qb_num_bins=1024,
        hidden_act="situ",
        situ_beta=4.0,
        situ_linear_beta=25.0,
        attnres_num_blocks=2,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        initializer_range=0.02,
        tie_word_embeddings=False,
        output_router_logits=False,
        router_aux_loss_coef=0.0,
        kernel_backend="auto",
        use_cache=True,
        prefill_chunk_size=32768,
        decode_cuda_graphs=True,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        if layer_types is None:
            layer_types = [
                "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_hidden_layers)
            ]
        self.layer_types = list(layer_types)
        self.num_attention_heads = num_attention_heads
        self.kv_lora_rank = kv_lora_rank
        self.q_lora_rank = q_lora_rank
        # `qk_nope_head_dim` is a property here; a Kimi Linear / DeepSeek config passes it as a field instead
        nope = kwargs.pop("qk_nope_head_dim", None)
        if nope is not None and qk_head_dim is None and isinstance(nope, int) and isinstance(qk_rope_head_dim, int):
            qk_head_dim = nope + qk_rope_head_dim
        self.qk_head_dim = (qk_head_dim if qk_head_dim is not None
                            else _divide(hidden_size, num_attention_heads, "num_attention_heads"))
        if nope is not None and nope != self.qk_head_dim - qk_rope_head_dim:
            raise ValueError(f"`qk_nope_head_dim` ({nope!r}) must equal qk_head_dim - qk_rope_head_dim = "
                             f"{self.qk_head_dim} - {qk_rope_head_dim!r}; give qk_head_dim (the total) or leave it out")
        self.v_head_dim = v_head_dim if v_head_dim is not None else self.qk_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.mla_rms_norm_eps = mla_rms_norm_eps
        self.mla_output_gate = mla_output_gate
        self.kda_num_heads = kda_num_heads
        self.kda_head_dim = (kda_head_dim if kda_head_dim is not None
                             else _divide(hidden_size, kda_num_heads, "kda_num_heads"))
        self.kda_short_conv_kernel_size = kda_short_conv_kernel_size
        # A float stays a float (an int -5 from a hand-written config.json too); anything else is checked below.
        self.kda_lower_bound = (float(kda_lower_bound) if isinstance(kda_lower_bound, int)
                                and not isinstance(kda_lower_bound, bool) else kda_lower_bound)
        self.kda_use_A_log = kda_use_A_log
        self.kda_output_gate_bias = kda_output_gate_bias
        self.kda_full_rank_output_gate = kda_full_rank_output_gate
        self.kda_chunk_size = kda_chunk_size
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.num_shared_experts = num_shared_experts
        self.moe_intermediate_size = moe_intermediate_size
        self.moe_latent_size = moe_latent_size
        self.first_k_dense_replace = first_k_dense_replace
        if mlp_layer_types is None and isinstance(first_k_dense_replace, int) and isinstance(num_hidden_layers, int):
            mlp_layer_types = ["dense" if i < first_k_dense_replace else "sparse" for i in range(num_hidden_layers)]
        self.mlp_layer_types = list(mlp_layer_types) if isinstance(mlp_layer_types, (list, tuple)) else mlp_layer_types
        self.intermediate_size = intermediate_size
        self.routed_scaling_factor = routed_scaling_factor
        self.latent_moe_routed_scaling = latent_moe_routed_scaling
        self.router_bias_update = router_bias_update
        self.router_bias_update_rate = router_bias_update_rate
        self.qb_num_bins = qb_num_bins
        self.hidden_act = hidden_act
        self.situ_beta = float(situ_beta)
        self.situ_linear_beta = float(situ_linear_beta)
        self.attnres_num_blocks = attnres_num_blocks
        self.rms_norm_eps = rms_norm_eps
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.output_router_logits = output_router_logits
        self.router_aux_loss_coef = router_aux_loss_coef
        self.kernel_backend = kernel_backend
        self.use_cache = use_cache
        self.prefill_chunk_size = prefill_chunk_size
        self.decode_cuda_graphs = decode_cuda_graphs
        # Names transformers' attention utilities look for (MLA expands K/V per head: no grouping).
        self.num_key_value_heads = num_attention_heads
        self.head_dim = self.qk_head_dim
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.tie_word_embeddings = tie_word_embeddings
        # Our checks first: they name the field and say why (transformers' own come after).
        self.validate_kdamoe()
        _warn_misspelt_fields(kwargs)
        super().__init__(**kwargs)

    @property
    def num_sparse_layers(self) -> int:
        """Number of decoder layers whose MLP is a routed MoE (``"sparse"`` in :attr:`mlp_layer_types`)."""
        return sum(t == "sparse" for t in self.mlp_layer_types)

    @property
    def qk_nope_head_dim(self) -> int:
        """Per-head query/key part ``qk_head_dim − qk_rope_head_dim``: the key width ``kv_b_proj`` produces."""
        return self.qk_head_dim - self.qk_rope_head_dim

    @property
    def mla_norm_eps(self) -> float:
        """Epsilon of the MLA ``q_a_layernorm`` / ``kv_a_layernorm``: ``mla_rms_norm_eps``, else ``rms_norm_eps``."""
        return self.rms_norm_eps if self.mla_rms_norm_eps is None else self.mla_rms_norm_eps

    @property
    def attnres_block_size(self) -> int:
        """Layers per Block AttnRes block, `ceil(L / N)`; 0 when AttnRes is off."""
        if self.attnres_num_blocks == 0:
            return 0
        return math.ceil(self.num_hidden_layers / self.attnres_num_blocks)

    def validate_kdamoe(self):
        """Check the fields; raises ValueError naming the bad one."""
        positive = (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
            "qk_head_dim", "v_head_dim", "kda_num_heads", "kda_head_dim", "kda_short_conv_kernel_size",
            "kda_chunk_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
            "intermediate_size", "qb_num_bins", "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}")
        for name in ("q_lora_rank", "moe_latent_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"`{name}` must be None or a positive integer, got {value!r}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"`layer_types` has {len(self.layer_types)} entries but `num_hidden_layers` is {self.num_hidden_layers}"
            )
        for i, layer_type in enumerate(self.layer_types):
            if layer_type not in LAYER_TYPES:
                raise ValueError(f"`layer_types[{i}]` is {layer_type!r}; expected one of {LAYER_TYPES}")
        if not isinstance(self.qk_rope_head_dim, int) or isinstance(self.qk_rope_head_dim, bool) or not (
                0 <= self.qk_rope_head_dim < self.qk_head_dim):
            raise ValueError(f"`qk_rope_head_dim` must be an integer in [0, qk_head_dim={self.qk_head_dim}) (the "
                             f"shared key part is inside the total head dim), got {self.qk_rope_head_dim!r}")
        if self.mla_rms_norm_eps is not None and (
                not isinstance(self.mla_rms_norm_eps, (int, float)) or isinstance(self.mla_rms_norm_eps, bool)
                or not math.isfinite(self.mla_rms_norm_eps) or self.mla_rms_norm_eps <= 0):
            raise ValueError(f"`mla_rms_norm_eps` must be None or a finite positive number, got "
                             f"{self.mla_rms_norm_eps!r}")
        if self.num_experts_per_tok >= self.num_experts:
            raise ValueError(
                f"`num_experts_per_tok` ({self.num_experts_per_tok}) must be smaller than `num_experts` "
                f"({self.num_experts}): Quantile Balancing reads the (k+1)-th routing score"
            )
        if self.num_shared_experts < 0:
            raise ValueError(f"`num_shared_experts` must be >= 0, got {self.num_shared_experts}")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ValueError(
                f"`first_k_dense_replace` must be in [0, num_hidden_layers={self.num_hidden_layers}], "
                f"got {self.first_k_dense_replace}"
            )
        if not isinstance(self.mlp_layer_types, list) or len(self.mlp_layer_types) != self.num_hidden_layers:
            raise ValueError(f"`mlp_layer_types` must be a list of {self.num_hidden_layers} entries (one per layer), "
                             f"got {self.mlp_layer_types!r}")
        for i, mlp_type in enumerate(self.mlp_layer_types):
            if mlp_type not in MLP_LAYER_TYPES:
                raise ValueError(f"`mlp_layer_types[{i}]` is {mlp_type!r}; expected one of {MLP_LAYER_TYPES}")
        check_kda_lower_bound(self.kda_lower_bound)
        if self.kda_lower_bound is None and self.kernel_backend == "triton":
            raise ValueError(
                "`kda_lower_bound` is None (Kimi Linear's unbounded gate) but `kernel_backend` is 'triton': kdamoe's "
                "Triton chunk kernel anchors 16-token sub-chunks and relies on the bounded gate (15*|g| <= 75 << "
                "ln(FLT_MAX) ~= 88.7); use kernel_backend='auto' (fla's KDA ops on CUDA, else PyTorch), 'fla' or "
                "'torch'"
            )
        for name in ("situ_beta", "situ_linear_beta", "rms_norm_eps", "routed_scaling_factor"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"`{name}` must be a finite positive number, got {value!r}")
        for name in ("initializer_range", "router_bias_update_rate", "router_aux_loss_coef"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ValueError(f"`{name}` must be a finite number >= 0, got {value!r}")
        check_prefill_chunk_size(self.prefill_chunk_size)
        for name in ("tie_word_embeddings", "output_router_logits", "use_cache", "decode_cuda_graphs", "kda_use_A_log",
                     "kda_output_gate_bias", "kda_full_rank_output_gate", "mla_output_gate",
                     "latent_moe_routed_scaling"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` must be True or False, got {getattr(self, name)!r}")
        if self.kernel_backend != "torch" and self.kda_head_dim not in KERNEL_HEAD_DIMS:
            raise ValueError(
                f"`kda_head_dim` is {self.kda_head_dim}: the GPU kernels take powers of two in [16, 256] "
                f"{KERNEL_HEAD_DIMS}; pick one of them, or set kernel_backend='torch' to run the PyTorch path only"
            )
        if not isinstance(self.attnres_num_blocks, int) or not 0 <= self.attnres_num_blocks <= self.num_hidden_layers:
            raise ValueError(
                f"`attnres_num_blocks` must be an integer in [0, num_hidden_layers={self.num_hidden_layers}] "
                f"(blocks group whole layers), got {self.attnres_num_blocks!r}"
            )
        if self.router_bias_update not in ROUTER_BIAS_UPDATES:
            raise ValueError(f"`router_bias_update` is {self.router_bias_update!r}; "
                             f"expected one of {ROUTER_BIAS_UPDATES}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"`hidden_act` is {self.hidden_act!r}; expected one of {HIDDEN_ACTS}")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(f"`kernel_backend` is {self.kernel_backend!r}; expected one of {KERNEL_BACKENDS}")


def check_prefill_chunk_size(chunk) -> None:
    """``ValueError`` unless ``chunk`` is None or an integer >= 0 (the config field and the forward argument)."""
    if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 0):
        raise ValueError(f"`prefill_chunk_size` must be None or an integer >= 0 (0 = no chunking), got {chunk!r}")


def check_kda_lower_bound(lower_bound) -> None:
    """``ValueError`` unless ``lower_bound`` is None (the unbounded gate) or a number in [-5, 0) (the bounded one):
    with 16-token sub-chunks the largest gate exponent of the bounded gate is ``15·|lower_bound|``."""
    if lower_bound is None:
        return
    if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float)) or not -5.0 <= lower_bound < 0.0:
        raise ValueError(
            f"`kda_lower_bound` must be None (unbounded gate) or satisfy -5 <= kda_lower_bound < 0, got "
            f"{lower_bound!r}: with 16-token sub-chunks the largest gate exponent is 15*|lower_bound|, which must stay "
            "well below ln(FLT_MAX) ~= 88.7"
        )


def _divide(total: int, parts: int, parts_name: str) -> int:
    """`total // parts`, raising when the head count does not divide the width."""
    if not isinstance(parts, int) or parts <= 0 or total % parts != 0:
        raise ValueError(f"`hidden_size` ({total}) is not divisible by `{parts_name}` ({parts}); "
                         "give the head dim explicitly")
    return total // parts


__all__ = ["KDAMoEConfig"]


def _warn_misspelt_fields(kwargs: dict) -> None:
    """Warn once per key for a keyword (a ``config.json`` key) that is not a field but is close to one of
    ``KDAMoEConfig``'s own: transformers keeps unknown keys as plain attributes that no layer reads, so a misspelt
    ``kda_lower_bund`` would otherwise be silently ignored. Keys with no close match (a user's own metadata, keys of
    newer transformers versions) pass unremarked."""
    own = [name for name in inspect.signature(KDAMoEConfig.__init__).parameters if name not in ("self", "kwargs")]
    for key in kwargs:
        if key.startswith("_") or key in own or key in ("head_dim", "num_key_value_heads"):  # set by __init__ itself
            continue
        match = difflib.get_close_matches(key, own, n=1, cutoff=0.8)
        if match:
            logger.warning(f"config field {key!r} is not a KDAMoEConfig field (did you mean {match[0]!r}?); it is kept "
                           "as an attribute that the model ignores")

