"""An independent Kimi K3 on the CPU: NeMo AutoModel 0.7.0's K3 writes a tiny K3-format checkpoint, its input ids and
its float32 logits, for kdamoe's K3 loader to be checked against (issue #37).

Usage (from the repository root, with the project's venv)::

    .venv/bin/python benchmarks/k3_reference/k3_reference.py --env .k3ref --out tests/fixtures/k3_tiny

``--env`` is a ``pip install --target`` folder (ignored by git) holding ``nemo-automodel==0.7.0``, ``fla-core==0.6.0``
and ``einops==0.8.2``, installed with ``--no-deps`` by this script when the folder is missing (or with ``--rebuild``):
nothing else is installed, the project's venv is not touched, and no CUDA torch can come in. The packages run on the
venv's own torch and transformers (5.25: NeMo 0.7.0 pins 5.18, but ``kimi_k3.{config,model,state_dict_adapter}``
import and run on 5.25). The folder is put first on ``sys.path``. Building it (three wheels, 4.9 MB, 21 MB
installed) took 0.9 to 2.2 s on the development machine, with or without ``--no-cache-dir`` (``meta.json`` records
the build time of the run that wrote it): well inside CI's 3 minutes. The whole script runs in about 12 s on 2 CPU
cores.

What runs: ``nemo_automodel.components.models.kimi_k3`` unmodified (``config.KimiK3TextConfig``,
``model.KimiK3ForCausalLM`` with ``BackendConfig(attn="sdpa", linear="torch", rms_norm="torch", experts="torch",
dispatcher="torch")``, ``state_dict_adapter.KimiK3StateDictAdapter``), in float32, eval mode (its MoE then takes
``_forward_reference_order``, the per-expert loop it documents as matching the checkpoint implementation). fla's
Triton operators cannot run on a CPU, so the names that ``kimi_k3/model.py`` imported from fla are replaced in that
module's namespace (nothing else is patched):

* ``chunk_kda`` and ``fused_recurrent_kda`` → fla's own ``fla.ops.kda.naive.naive_recurrent_kda`` (the token-by-token
  delta rule, float32), after the L2 normalisation of q and k that the kernels apply under
  ``use_qk_l2norm_in_kernel=True`` — written here from fla's kernel ``fla/modules/norm/l2norm.py``
  (``x / sqrt(Σx² + 1e-6)``); the default scale ``K^-1/2`` is the naive function's own. ``cu_seqlens`` and
  ``initial_state`` are refused (the run uses neither). ``safe_gate`` / ``transpose_state_layout`` only choose kernel
  variants and are ignored.
* ``fused_kda_gate`` → fla's own ``fla.ops.kda.gate.naive_kda_lowerbound_gate`` (``lower_bound`` set: K3) or
  ``naive_kda_gate`` (no bound), same signature as fla 0.6.0's fused gate, the signature NeMo detected at import.
* ``ShortConvolution`` → a subclass of fla's ``ShortConvolution`` (same parameters and names, ``nn.Conv1d`` with
  ``groups = channels`` and padding ``W − 1``) whose forward is that convolution's first ``T`` outputs through SiLU
  (fla's ``causal_conv1d``: a causal depthwise convolution with the ``silu`` activation); fla has no torch reference
  of it.
* ``FusedRMSNormGated`` → a subclass of fla's ``FusedRMSNormGated`` (same parameters) whose forward is
  ``x · rsqrt(mean(x²) + eps) · weight · σ(g)`` in float32 cast to x's dtype, the formula of fla's kernel
  ``fla/modules/norm/fused_norm_gate.py`` for ``activation="sigmoid"``; fla's torch ``rms_norm_ref`` has only the
  SiLU gate.

The model: the tiny K3-shaped config below (5 layers: KDA at 1–3, MLA at 4 and 5 — the released rule, every 4th
layer plus the last; layer 1 dense, 2–5 latent MoE with 2 shared experts; full-rank KDA output gate, lower-bounded
KDA gate, MLA with q-LoRA, a shared key part and its output gate; AttnRes blocks of 2 layers, so 5 layers end in a
block of 1), built by NeMo, initialised by NeMo (``initialize_weights``), then every floating parameter and buffer
moved by seeded Gaussian noise (std 0.1 × its RMS, 0.1 where it is all zeros), so no norm stays at one and no bias
at zero. The routed experts are then made MXFP4 by construction: random ``weight_packed`` bytes and ``weight_scale``
bytes (118–121) per expert projection in K3's layout, decoded by NeMo's ``dequantize_mxfp4`` when NeMo's adapter
loads the checkpoint (``from_hf``) into the model, so the float32 model computes with exactly those values.

Written to ``--out``:

* ``model.safetensors``: the checkpoint as NeMo's adapter lays it out for the released HF model (``to_hf``: keys
  under ``language_model.``, ``block_sparse_moe.`` on MoE layers, ``A_log`` padded to 128 entries, per-expert
  ``w1`` / ``w3`` / ``w2``), every tensor float32 except the routed experts, stored as ``…w{1,2,3}.weight_packed``
  (uint8 ``[out, in/2]``) and ``…w{1,2,3}.weight_scale`` (uint8 ``[out, in/32]``). Text model only: no
  ``vision_tower.`` / ``mm_projector.`` tensors.
* ``config.json``: ``KimiK3Config(text_config=<the tiny text config>).to_dict()`` (top-level ``model_type``
  ``kimi_k3`` with a ``text_config`` whose ``model_type`` is ``kimi_linear``, as released; its ``vision_config`` is
  NeMo's default, describing weights this file does not hold).
* ``reference.safetensors``: ``input_ids`` int64 ``[2, 24]`` and ``logits`` float32 ``[2, 24, vocab]``.
* ``meta.json``: versions, seeds, the command, the build time, the checks below, largest |logit|.

Checks made before writing (the script fails otherwise): each replaced operator agrees within 1e-5 (float32) with a
version written elsewhere — transformers' Kimi Linear PyTorch paths for the convolution, the gated norm and the delta
rule (``recurrent_kimi_delta_attention``, with its own L2 norm), NeMo's own ``_torch_kda_gate`` for the gate
(``meta.json`` records the differences); the adapter's ``from_hf`` of the written checkpoint gives
back the model's state dict exactly (the file is in the layout NeMo reads), and ``to_hf`` then ``from_hf`` of the
float state dict is the identity.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

PACKAGES = ("nemo-automodel==0.7.0", "fla-core==0.6.0", "einops==0.8.2")
SEED = 0
BATCH, SEQ = 2, 24

TINY_TEXT_CONFIG = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4,
    num_key_value_heads=4, rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False, max_position_embeddings=1024,
    moe_intermediate_size=32, num_experts=8, num_experts_per_token=2, num_shared_experts=2,
    routed_scaling_factor=2.5, first_k_dense_replace=1, moe_layer_freq=1, num_expert_group=1, topk_group=1,
    routed_expert_hidden_size=32, latent_moe_use_norm=True, moe_renormalize=True, moe_router_activation_func="sigmoid",
    q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, mla_use_nope=True,
    mla_use_output_gate=True,
    linear_attn_config=dict(head_dim=16, num_heads=4, short_conv_kernel_size=4, kda_layers=[1, 2, 3],
                            full_attn_layers=[4, 5], use_full_rank_gate=True, gate_lower_bound=-5.0),
    attn_res_block_size=2, activation_situ_beta=4.0, activation_situ_linear_beta=25.0, hidden_act="situ",
    # Runtime switches of NeMo's implementation (not architecture): the gate and l2norm paths that reach the
    # operators replaced below.
    kda_mode="chunk", kda_use_fused_gate=True, kda_use_qk_l2norm_in_kernel=True, kda_chunk_impl="fla",
)


def build_env(target: Path, no_cache: bool) -> float:
    """``pip install --no-deps --target`` the three packages; returns the seconds it took."""
    if target.exists():
        shutil.rmtree(target)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(target),
           *PACKAGES]
    if no_cache:
        cmd.insert(4, "--no-cache-dir")
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - start


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's l2norm kernel (fla/modules/norm/l2norm.py): x · 1/sqrt(Σx² + eps) over the last dim, in float32."""
    xf = x.float()
    return (xf / torch.sqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(x.dtype)


def patch_fla_names(model_module) -> list[str]:
    """Replace the fla names of ``kimi_k3/model.py`` with CPU implementations (see the module docstring)."""
    import torch.nn.functional as F  # noqa: PLC0415 (kept next to the CPU operators it serves)
    from fla.modules import FusedRMSNormGated, ShortConvolution  # noqa: PLC0415 (on sys.path only after --env)
    from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate  # noqa: PLC0415 (idem)
    from fla.ops.kda.naive import naive_recurrent_kda  # noqa: PLC0415 (idem)

    def kda_cpu(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kernel_variant):
        if cu_seqlens is not None or initial_state is not None or kernel_variant.get("cp_context") is not None:
            raise NotImplementedError("the CPU reference runs whole unpadded sequences only")
        if use_qk_l2norm_in_kernel:
            q, k = _l2norm(q), _l2norm(k)
        return naive_recurrent_kda(q, k, v, g, beta, scale=scale, output_final_state=output_final_state)

    def kda_gate_cpu(g, A_log=None, dt_bias=None, lower_bound=None, output_dtype=torch.float32):
        if lower_bound is None:
            return naive_kda_gate(g, A_log, dt_bias, output_dtype=output_dtype)
        return naive_kda_lowerbound_gate(g, A_log, dt_bias, lower_bound=lower_bound, output_dtype=output_dtype)

    class ShortConvolutionCPU(ShortConvolution):
        def forward(self, x, residual=None, mask=None, cache=None, output_final_state=False, cu_seqlens=None,
                    **kwargs):
            if residual is not None or mask is not None or cache is not None or cu_seqlens is not None:
                raise NotImplementedError("the CPU reference runs whole unpadded sequences only")
            T = x.shape[1]
            y = self._conv_forward(x.transpose(1, 2), self.weight, self.bias)[..., :T].transpose(1, 2)
            if self.activation is not None:
                y = F.silu(y)
            return y, None

    class FusedRMSNormGatedCPU(FusedRMSNormGated):
        def forward(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
            if residual is not None or prenorm:
                raise NotImplementedError("the CPU reference has no residual / prenorm path")
            if self.activation != "sigmoid":
                raise NotImplementedError("K3's KDA output norm uses the sigmoid gate")
            xf = x.float()
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
            return (y * torch.sigmoid(g.float())).to(x.dtype)

    model_module.chunk_kda = kda_cpu
    model_module.fused_recurrent_kda = kda_cpu
    model_module.fused_kda_gate = kda_gate_cpu
    model_module.ShortConvolution = ShortConvolutionCPU
    model_module.FusedRMSNormGated = FusedRMSNormGatedCPU
    return ["chunk_kda", "fused_recurrent_kda", "fused_kda_gate", "ShortConvolution", "FusedRMSNormGated"]


def check_cpu_ops(model_module, tol: float = 1e-5) -> dict[str, float]:
    """Compare the CPU operators patched into ``model_module`` with implementations written elsewhere: transformers'
    Kimi Linear PyTorch paths (``transformers/models/kimi_linear/modeling_kimi_linear.py``: ``causal_conv1d_fn``,
    ``KimiLinearRMSNormGated``, ``recurrent_kimi_delta_attention`` with its own L2 norm) and NeMo's own float32 gate
    ``_torch_kda_gate``. Returns the largest absolute difference of each; raises if one exceeds ``tol`` (float32)."""
    from transformers.models.kimi_linear import modeling_kimi_linear as tkl  # noqa: PLC0415 (only this check needs it)

    g = torch.Generator().manual_seed(1)
    B, T, H, K = 2, 24, 4, 16
    diffs = {}

    conv = model_module.ShortConvolution(hidden_size=H * K, kernel_size=4, activation="silu", dtype=torch.float32)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=g))
        x = torch.randn(B, T, H * K, generator=g)
        ours = conv(x)[0]
        theirs = tkl.causal_conv1d_fn(x.transpose(1, 2), conv.weight.squeeze(1), None, activation="silu")
    diffs["ShortConvolution"] = (ours - theirs.transpose(1, 2)).abs().max().item()

    norm = model_module.FusedRMSNormGated(K, eps=1e-5, activation="sigmoid", dtype=torch.float32)
    ref_norm = tkl.KimiLinearRMSNormGated(K, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(K, generator=g))
        ref_norm.weight.copy_(norm.weight)
        o, gate = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, K, generator=g)
        diffs["FusedRMSNormGated"] = (norm(o, gate) - ref_norm(o, gate)).abs().max().item()

    raw = torch.randn(B, T, H * K, generator=g)
    a_log, dt_bias = torch.rand(H, generator=g).mul(15).add(1).log(), torch.randn(H * K, generator=g)
    ours = model_module.fused_kda_gate(raw.view(B, T, H, K), a_log, dt_bias=dt_bias, lower_bound=-5.0)
    diffs["fused_kda_gate"] = (ours - model_module._torch_kda_gate(raw, a_log, K, dt_bias, -5.0)).abs().max().item()

    q, k, v = (torch.randn(B, T, H, K, generator=g) for _ in range(3))
    decay, beta = -5.0 * torch.sigmoid(torch.randn(B, T, H, K, generator=g)), torch.rand(B, T, H, generator=g)
    ours = model_module.chunk_kda(q=q, k=k, v=v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True)[0]
    theirs = tkl.recurrent_kimi_delta_attention(q, k, v, decay, beta, None, False, use_qk_l2norm_in_kernel=True)[0]
    diffs["chunk_kda"] = (ours - theirs).abs().max().item()

    bad = {name: d for name, d in diffs.items() if not d <= tol}
    if bad:
        raise RuntimeError(f"CPU operators differ from their independent versions by more than {tol}: {bad}")
    return diffs


def _perturb(tensors: dict[str, torch.Tensor], generator: torch.Generator) -> None:
    for name in sorted(tensors):
        t = tensors[name]
        if not t.is_floating_point():
            continue
        rms = t.double().pow(2).mean().sqrt().item()
        std = 0.1 * rms if rms > 0 else 0.1
        t.add_(torch.randn(t.shape, generator=generator, dtype=t.dtype) * std)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", type=Path, default=Path(".k3ref"), help="pip --target folder of the three packages")
    ap.add_argument("--rebuild", action="store_true", help="reinstall the --env folder even if it exists")
    ap.add_argument("--no-cache", action="store_true", help="build the --env folder with pip's --no-cache-dir")
    ap.add_argument("--out", type=Path, required=True, help="folder to write the checkpoint and the logits to")
    args = ap.parse_args(argv)

    build_s = None
    if args.rebuild or not (args.env / "nemo_automodel").is_dir():
        build_s = build_env(args.env, args.no_cache)
        print(f"built {args.env} in {build_s:.1f} s")
    sys.path.insert(0, str(args.env.resolve()))

    import nemo_automodel.components.models.kimi_k3.model as k3_model  # noqa: PLC0415 (on sys.path only after --env)
    from nemo_automodel.components.models.common import BackendConfig  # noqa: PLC0415 (idem)
    from nemo_automodel.components.models.kimi_k3.config import KimiK3Config, KimiK3TextConfig  # noqa: PLC0415
    from nemo_automodel.components.models.kimi_k3.state_dict_adapter import dequantize_mxfp4  # noqa: PLC0415

    patched = patch_fla_names(k3_model)
    op_diffs = check_cpu_ops(k3_model)
    torch.manual_seed(SEED)
    text_config = KimiK3TextConfig(**TINY_TEXT_CONFIG, torch_dtype="float32")
    backend = BackendConfig(attn="sdpa", linear="torch", rms_norm="torch", experts="torch", dispatcher="torch",
                            enable_hf_state_dict_adapter=True)
    model = k3_model.KimiK3ForCausalLM(text_config, backend=backend)
    model.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    model.eval()
    dtypes = {p.dtype for p in model.parameters()} | {b.dtype for b in model.buffers() if b.is_floating_point()}
    if dtypes != {torch.float32}:
        raise RuntimeError(f"the reference must run in float32, its tensors are {dtypes}")
    adapter = model.state_dict_adapter

    generator = torch.Generator().manual_seed(SEED)
    native = {k: v.detach().clone() for k, v in model.state_dict().items()}
    _perturb(native, generator)
    hf = adapter.to_hf(native)
    assert all(v.dtype == torch.float32 for v in hf.values())
    # Routed experts: random MXFP4 bytes in K3's layout, decoded by NeMo's adapter on load.
    checkpoint = {}
    for key in sorted(hf):
        value = hf[key]
        if ".block_sparse_moe.experts." in key and key.endswith(".weight"):
            out_features, in_features = value.shape
            checkpoint[f"{key}_packed"] = torch.randint(0, 256, (out_features, in_features // 2), dtype=torch.uint8,
                                                        generator=generator)
            checkpoint[f"{key}_scale"] = torch.randint(118, 122, (out_features, in_features // 32),
                                                       dtype=torch.uint8, generator=generator)
        else:
            checkpoint[key] = value.contiguous()
    loaded = adapter.from_hf(dict(checkpoint))
    missing, unexpected = model.load_state_dict(loaded, strict=True)
    assert not missing and not unexpected
    state = model.state_dict()
    # The file is in the layout NeMo reads: its from_hf gives the model's tensors back, and to_hf inverts from_hf.
    round_trip = adapter.to_hf({k: v.detach().clone() for k, v in state.items()})
    for key, value in round_trip.items():
        if f"{key}_packed" in checkpoint:
            expect = dequantize_mxfp4(checkpoint[f"{key}_packed"], checkpoint[f"{key}_scale"], dtype=torch.float32)
        else:
            expect = checkpoint[key]
        assert torch.equal(value, expect), key
    assert set(round_trip) == {k.removesuffix("_packed") for k in checkpoint if not k.endswith("_scale")}

    input_ids = torch.randint(3, text_config.vocab_size, (BATCH, SEQ), generator=generator)
    with torch.no_grad():
        logits = model(input_ids).logits
    if logits.dtype != torch.float32 or not torch.isfinite(logits).all():
        raise RuntimeError("the reference forward gave no finite logits")

    args.out.mkdir(parents=True, exist_ok=True)
    save_file(checkpoint, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    save_file({"input_ids": input_ids.contiguous(), "logits": logits.contiguous()},
              str(args.out / "reference.safetensors"))
    config = KimiK3Config(text_config=text_config).to_dict()
    (args.out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    import fla  # noqa: PLC0415 (on sys.path only after --env)
    import nemo_automodel  # noqa: PLC0415 (idem)
    import transformers  # noqa: PLC0415 (imported late like the two above, for the versions only)

    meta = {
        "command": "python benchmarks/k3_reference/k3_reference.py " + " ".join(argv or sys.argv[1:]),
        "packages": list(PACKAGES),
        "versions": {"nemo_automodel": nemo_automodel.__version__, "fla": fla.__version__,
                     "transformers": transformers.__version__, "torch": torch.__version__},
        "env_build_seconds": None if build_s is None else round(build_s, 1),
        "seed": SEED, "input_shape": [BATCH, SEQ], "dtype": "float32",
        "patched_fla_names": patched,
        "patched_ops_max_abs_diff_vs_independent": op_diffs,
        "checks": ["from_hf(checkpoint) loads strictly", "to_hf(model) == checkpoint (experts MXFP4-decoded)"],
        "max_abs_logit": logits.abs().max().item(), "logit_std": logits.std().item(),
        "n_tensors": len(checkpoint), "n_parameters": sum(p.numel() for p in model.parameters()),
    }
    (args.out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps(meta, indent=2))
    return meta


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
