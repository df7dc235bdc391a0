"""kdamoe's Kimi K3 loader against NeMo AutoModel 0.7.0's own K3 on the GPU, in bf16, with fla's Triton kernels (issue
#37, item 3, the GPU half; the CPU half in float32 is ``tests/test_kimi_k3_checkpoints.py`` against the fixture that
``benchmarks/k3_reference/k3_reference.py`` wrote).

Parts (``--only``):

* ``fixture``: the tiny K3 of ``tests/fixtures/k3_tiny`` (5 layers, MXFP4 experts; ``--fixture``). NeMo's
  ``KimiK3ForCausalLM`` is built from that folder's ``text_config`` in bf16 and loaded through NeMo's own
  ``KimiK3StateDictAdapter.from_hf`` from its ``model.safetensors`` (MXFP4 decoded by NeMo), strictly, as the CPU
  reference script loads it; kdamoe's model comes from the same folder through
  ``KDAMoEForCausalLM.from_pretrained(folder, dtype=bfloat16, kernel_backend="auto")`` (kdamoe's Triton kernels for
  the lower-bounded gate). Both run the fixture's ``input_ids`` ``[2, 24]``. Reported, each as
  max |Δlogit| / max |logit of the second|: NeMo bf16 vs the fixture's float32 logits, kdamoe bf16 vs the fixture,
  kdamoe bf16 vs NeMo bf16; plus kdamoe float32 on the device vs the fixture (the float32 bar of the CPU test, on the
  GPU's kernels).
* ``large``: a random K3-shaped model (default 4 layers: KDA at 1–3, MLA at 4; hidden 1024, 8 KDA heads × 128, latent
  MoE 16 experts top 2 with 2 shared; ``--large-*``) at ``T = --large-T`` (2048), batch 1. NeMo builds and initialises
  it in float32 on the CPU (seeded), every floating tensor is moved by seeded noise (std 0.1 × its RMS) as the CPU
  reference does, NeMo's ``to_hf`` writes it as a K3 folder (experts unquantized ``…w{1,2,3}.weight``) in a temporary
  folder, and kdamoe loads that folder; NeMo's bf16 model loads the same float32 tensors (cast by
  ``load_state_dict``). Reported: kdamoe bf16 vs NeMo bf16, and both against kdamoe in float32 on the device with
  ``kernel_backend="torch"`` (kdamoe's PyTorch path: a float32 reference that uses no Triton kernel), and the
  forward time of each bf16 model (``triton.testing.do_bench`` median, ms: not the point of the script).

NeMo's configuration: ``BackendConfig(attn="sdpa", linear="torch", rms_norm="torch", experts="torch",
dispatcher="torch")`` (eval mode: its MoE takes the per-expert reference order) and its text-config switches
``kda_mode="chunk"``, ``kda_chunk_impl="fla"``, ``kda_use_fused_gate=True``, ``kda_use_qk_l2norm_in_kernel=True``,
``kda_conv_backend="triton"``: fla's ``chunk_kda``, ``fused_kda_gate`` (with ``lower_bound``), ``ShortConvolution``
(Triton) and ``FusedRMSNormGated`` — no name of fla is replaced (``stack.nemo_ops`` records the module each name
of NeMo's ``kimi_k3.model`` comes from). In eval mode on one process NeMo's MoE takes its per-expert reference
order whatever ``experts`` says; its other ``attn`` / ``linear`` / ``rms_norm`` choices are TransformerEngine or QuACK
paths, absent from the device.

Writes ``k3_gpu.json`` / ``k3_gpu.md`` into ``--out`` after every measurement. ``--device cpu`` (the smoke mode of
``tests/test_bench_k3_gpu.py``) runs kdamoe alone on the fixture in float32 on the CPU and records NeMo's rows as
skipped: it checks the script's plumbing, not the comparison. ``--nemo-path`` puts a ``pip install --target`` folder
holding ``nemo_automodel`` and ``fla`` first on ``sys.path`` (the device script installs them from wheels).
"""

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (  # noqa: E402  (sys.path above)
    REPO,
    PartBench,
    Recorder,
    add_run_args,
    check_at_least,
    finish_run_args,
    fmt,
    run_parts,
    stack_versions,
    time_ms,
)

PARTS = ("fixture", "large")
FIXTURE = os.path.join(REPO, "tests", "fixtures", "k3_tiny")
SEED = 0
# NeMo's switches that select fla's Triton kernels (see the module docstring); set on every NeMo text config here.
NEMO_KDA_SWITCHES = dict(kda_mode="chunk", kda_chunk_impl="fla", kda_use_fused_gate=True,
                         kda_use_qk_l2norm_in_kernel=True, kda_conv_backend="triton", situ_backend="torch",
                         attn_res_triton=False)
NEMO_OPS = ("chunk_kda", "fused_recurrent_kda", "fused_kda_gate", "ShortConvolution", "FusedRMSNormGated")
LOW_DTYPE = torch.bfloat16  # the dtype of the rows named "bf16"


def nemo_runs_on(device: str) -> bool:
    """Whether NeMo's rows (and the bf16 rows) run on ``device``: CUDA only, fla's Triton kernels need it. A module
    function, so a CPU check of the plumbing can replace it together with fla's names (the CPU reference's
    ``patch_fla_names``) and ``LOW_DTYPE``."""
    return device.startswith("cuda")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(p, PARTS, out_default="bench_out", out_help="folder of k3_gpu.json / .md", budget_default=360.0)
    p.add_argument("--fixture", default=FIXTURE, help="the tiny K3 folder with reference.safetensors")
    p.add_argument("--nemo-path", default=None, help="folder put first on sys.path (nemo_automodel, fla)")
    p.add_argument("--large-layers", type=int, default=4, help="layers of the large config (the last is MLA)")
    p.add_argument("--large-hidden", type=int, default=1024)
    p.add_argument("--large-heads", type=int, default=8, help="KDA heads (× --large-head-dim) and MLA heads")
    p.add_argument("--large-head-dim", type=int, default=128)
    p.add_argument("--large-T", type=int, default=2048, help="tokens of the large forward (batch 1)")
    a = finish_run_args(p, p.parse_args(argv), PARTS, {})
    check_at_least(p, a, ("large_layers",), 2)
    check_at_least(p, a, ("large_hidden", "large_heads", "large_head_dim", "large_T"), 1)
    if not os.path.isfile(os.path.join(a.fixture, "reference.safetensors")):
        p.error(f"--fixture {a.fixture!r} holds no reference.safetensors")
    if a.nemo_path is not None and not os.path.isdir(os.path.join(a.nemo_path, "nemo_automodel")):
        p.error(f"--nemo-path {a.nemo_path!r} holds no nemo_automodel folder")
    return a


class K3Recorder(Recorder):
    stem = "k3_gpu"
    strip_paths = True

    def rows(self) -> list[dict]:
        return [{"part": group, "case": key, **entry} for group, entries in self.raw.items() if group in PARTS
                for key, entry in entries.items() if isinstance(entry, dict) and "rel_max_diff" in entry]

    def markdown(self, doc: dict) -> str:
        s, st = doc["settings"], doc["stack"]
        lines = [f"# kdamoe's K3 vs NeMo AutoModel's K3 ({st.get('gpu', '?')})", "",
                 f"torch {st.get('torch')}, triton {st.get('triton')}, transformers {st.get('transformers')}, "
                 f"fla {st.get('fla')}, nemo_automodel {st.get('nemo_automodel')}; NeMo's fla names from: "
                 f"{st.get('nemo_ops')}.", "",
                 f"large: {s.get('large')}.", "",
                 "rel = max |Δlogit| / max |logit of the reference| (the second model named).", "",
                 "| part | comparison | rel | max abs Δ | max abs ref | fwd ms |", "|---|---|---|---|---|---|"]
        for r in doc["rows"]:
            lines.append(f"| {r['part']} | {r['case']} | {fmt(r['rel_max_diff'])} | {fmt(r.get('max_abs_diff'))} | "
                         f"{fmt(r.get('max_abs_ref'))} | {fmt(r.get('ms'))} |")
        for group, entries in doc["raw"].items():
            for key, entry in entries.items():
                if not (isinstance(entry, dict) and "rel_max_diff" in entry):
                    lines.append(f"- {group}/{key}: {entry}")
        lines += ["", *(f"- {key}: {fmt(value) if isinstance(value, float) else value}"
                        for key, value in doc["notes"].items())]
        return "\n".join(lines) + "\n"


def compare(logits: torch.Tensor, reference: torch.Tensor) -> dict:
    """max |logits − reference| / max |reference| (both taken in float32 on the CPU), with its two terms.

    Raises ValueError when the shapes differ or a logit is not finite (a broken run, not a large difference)."""
    a, b = logits.detach().float().cpu(), reference.detach().float().cpu()
    if a.shape != b.shape:
        raise ValueError(f"logits of shape {tuple(a.shape)} against a reference of shape {tuple(b.shape)}")
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise ValueError("a logit is not finite")
    diff, ref = (a - b).abs().max().item(), b.abs().max().item()
    return {"rel_max_diff": diff / ref, "max_abs_diff": diff, "max_abs_ref": ref}


def load_kdamoe(folder: str, device: str, dtype: torch.dtype, kernel_backend: str):
    """kdamoe's model of a K3 folder through ``KDAMoEForCausalLM.from_pretrained`` (its K3 loader), on ``device``."""
    from kdamoe import KDAMoEForCausalLM  # noqa: PLC0415  (after --nemo-path: transformers is imported once)

    model = KDAMoEForCausalLM.from_pretrained(folder, dtype=dtype, kernel_backend=kernel_backend)
    return model.to(device).eval()


def param_dtypes(model) -> dict:
    """How many parameters (tensors) of each dtype ``model`` holds: what "bf16" meant for it (each side keeps some
    tensors in float32, e.g. NeMo's KDA convolutions, ``A_log``, ``dt_bias`` and gated-norm weight)."""
    counts: dict = {}
    for p in model.parameters():
        counts[str(p.dtype).removeprefix("torch.")] = counts.get(str(p.dtype).removeprefix("torch."), 0) + 1
    return counts


def kdamoe_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids.to(model.device), use_cache=False).logits


def nemo_modules():
    """NeMo's K3 modules (imported from ``sys.path``: the device script installs the wheel there)."""
    import nemo_automodel  # noqa: PLC0415  (optional: only the GPU comparison needs it)
    import nemo_automodel.components.models.kimi_k3.model as k3_model  # noqa: PLC0415
    from nemo_automodel.components.models.common import BackendConfig  # noqa: PLC0415
    from nemo_automodel.components.models.kimi_k3 import config as k3_config  # noqa: PLC0415

    return nemo_automodel, k3_model, BackendConfig, k3_config


def nemo_text_config(text: dict, dtype: torch.dtype):
    """NeMo's ``KimiK3TextConfig`` of a K3 ``text_config`` dict, with the fla switches and ``dtype``."""
    _, _, _, k3_config = nemo_modules()
    fields = {k: v for k, v in text.items() if k not in ("model_type", "architectures", "dtype", "torch_dtype",
                                                          "transformers_version", "_name_or_path")}
    fields.update(NEMO_KDA_SWITCHES)
    return k3_config.KimiK3TextConfig(**fields, torch_dtype=str(dtype).removeprefix("torch."))


def build_nemo(text_config, dtype: torch.dtype):
    """NeMo's ``KimiK3ForCausalLM`` of ``text_config`` in ``dtype`` (its own initialisation; weights loaded later)."""
    _, k3_model, BackendConfig, _ = nemo_modules()
    backend = BackendConfig(attn="sdpa", linear="torch", rms_norm="torch", experts="torch", dispatcher="torch",
                            enable_hf_state_dict_adapter=True)
    torch.manual_seed(SEED)
    model = k3_model.KimiK3ForCausalLM(text_config, backend=backend)
    model.initialize_weights(buffer_device=torch.device("cpu"), dtype=dtype)
    return model


def load_nemo_native(model, state: dict, device: str):
    """Load NeMo-native ``state`` strictly into ``model`` (``load_state_dict`` casts to each parameter's dtype), move
    it to ``device``, eval mode."""
    missing, unexpected = model.load_state_dict(state, strict=True)
    if missing or unexpected:
        raise RuntimeError(f"NeMo's model did not load strictly: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model.to(device).eval()


def nemo_logits(model, ids: torch.Tensor, device: str) -> torch.Tensor:
    with torch.no_grad():
        return model(ids.to(device)).logits


def nemo_ops_origin() -> dict:
    """The module each fla name of NeMo's ``kimi_k3.model`` comes from (fla's own, nothing replaced)."""
    _, k3_model, _, _ = nemo_modules()
    return {name: getattr(getattr(k3_model, name), "__module__", "?") for name in NEMO_OPS}


def large_text_config(a) -> dict:
    """A K3-shaped text config dict (NeMo's field names) of the ``--large-*`` sizes; the last layer is MLA."""
    d, H, K, n = a.large_hidden, a.large_heads, a.large_head_dim, a.large_layers
    return dict(
        vocab_size=4096, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=n, num_attention_heads=H,
        num_key_value_heads=H, rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, max_position_embeddings=max(4096, a.large_T),
        moe_intermediate_size=d // 4, num_experts=16, num_experts_per_token=2, num_shared_experts=2,
        routed_scaling_factor=2.5, first_k_dense_replace=1, moe_layer_freq=1, num_expert_group=1, topk_group=1,
        routed_expert_hidden_size=d // 2, latent_moe_use_norm=True, moe_renormalize=True,
        moe_router_activation_func="sigmoid", q_lora_rank=d // 2, kv_lora_rank=d // 4, qk_nope_head_dim=K,
        qk_rope_head_dim=K // 2, v_head_dim=K, mla_use_nope=True, mla_use_output_gate=True,
        linear_attn_config=dict(head_dim=K, num_heads=H, short_conv_kernel_size=4,
                                kda_layers=list(range(1, n)), full_attn_layers=[n], use_full_rank_gate=True,
                                gate_lower_bound=-5.0),
        attn_res_block_size=2, activation_situ_beta=4.0, activation_situ_linear_beta=25.0, hidden_act="situ")


def perturb(tensors: dict, generator: torch.Generator) -> None:
    """Move every floating tensor by Gaussian noise of std 0.1 × its RMS (0.1 where it is all zeros), in name order:
    no norm stays at one, no bias at zero (the CPU reference's rule)."""
    for name in sorted(tensors):
        t = tensors[name]
        if t.is_floating_point():
            rms = t.double().pow(2).mean().sqrt().item()
            t.add_(torch.randn(t.shape, generator=generator, dtype=t.dtype) * (0.1 * rms if rms > 0 else 0.1))


def main(argv=None):
    a = parse_args(argv)
    if a.nemo_path:
        sys.path.insert(0, os.path.abspath(a.nemo_path))
    cuda = a.device.startswith("cuda")
    os.makedirs(a.out, exist_ok=True)
    if not cuda:
        torch.set_num_threads(1)
    from safetensors.torch import load_file, save_file  # noqa: PLC0415  (after --nemo-path, like every import below)

    rec = K3Recorder(a.out, a.budget_s, {"device": a.device, "fixture": os.path.relpath(a.fixture, REPO),
                                         "large": {"layers": a.large_layers, "hidden": a.large_hidden,
                                                   "kda_heads": a.large_heads, "head_dim": a.large_head_dim,
                                                   "T": a.large_T, "batch": 1}})
    rec.stack = stack_versions(cuda)
    gpu = nemo_runs_on(a.device)
    if gpu:
        try:
            nemo_automodel = nemo_modules()[0]
            rec.stack["nemo_automodel"] = nemo_automodel.__version__
            rec.stack["nemo_ops"] = nemo_ops_origin()
        except Exception as err:  # the rows that need NeMo record the same error; kdamoe's rows still run
            rec.stack["nemo_automodel"] = f"import failed: {err!r}"[:300]
    rec.save()
    bf16 = LOW_DTYPE

    bench = PartBench(a, rec, cuda)

    def fixture():
        reference = load_file(os.path.join(a.fixture, "reference.safetensors"))
        ids, ref_logits = reference["input_ids"], reference["logits"]
        if rec.need("fixture", "kdamoe fp32 vs fixture fp32", 10):
            try:
                model = load_kdamoe(a.fixture, a.device, torch.float32, "auto")
                rec.put("fixture", "kdamoe fp32 vs fixture fp32", compare(kdamoe_logits(model, ids), ref_logits))
                del model
            except Exception:
                rec.error("fixture", "kdamoe fp32 vs fixture fp32")
        ours = None
        if gpu and rec.need("fixture", "kdamoe bf16 vs fixture fp32", 10):
            try:
                model = load_kdamoe(a.fixture, a.device, bf16, "auto")
                ours = kdamoe_logits(model, ids)
                rec.notes["fixture kdamoe bf16 param dtypes"] = param_dtypes(model)
                rec.put("fixture", "kdamoe bf16 vs fixture fp32", compare(ours, ref_logits))
                del model
            except Exception:
                rec.error("fixture", "kdamoe bf16 vs fixture fp32")
        if not gpu:
            for key in ("NeMo bf16 vs fixture fp32", "kdamoe bf16 vs NeMo bf16"):
                rec.put("fixture", key, "skipped: NeMo's K3 runs fla's Triton kernels, which need CUDA")
            return
        if not rec.need("fixture", "NeMo bf16 vs fixture fp32", 30):
            return
        try:
            k3 = json.load(open(os.path.join(a.fixture, "config.json")))
            model = build_nemo(nemo_text_config(k3["text_config"], bf16), bf16)
            state = model.state_dict_adapter.from_hf(load_file(os.path.join(a.fixture, "model.safetensors")))
            model = load_nemo_native(model, state, a.device)
            theirs = nemo_logits(model, ids, a.device)
            rec.notes["fixture NeMo bf16 param dtypes"] = param_dtypes(model)
            rec.put("fixture", "NeMo bf16 vs fixture fp32", compare(theirs, ref_logits))
            del model
        except Exception:
            rec.error("fixture", "NeMo bf16 vs fixture fp32")
            return
        if ours is not None:
            rec.put("fixture", "kdamoe bf16 vs NeMo bf16", compare(ours, theirs))

    def large():
        if not gpu:
            rec.put("large", "part", "skipped: needs CUDA (NeMo's K3 runs fla's Triton kernels)")
            return
        if not rec.need("large", "build", 90):
            return
        t0 = time.time()
        text = large_text_config(a)
        _, _, _, k3_config = nemo_modules()
        nemo = build_nemo(nemo_text_config(text, torch.float32), torch.float32)
        native = {k: v.detach().clone() for k, v in nemo.state_dict().items()}
        perturb(native, torch.Generator().manual_seed(SEED))
        hf = {k: v.contiguous() for k, v in nemo.state_dict_adapter.to_hf(native).items()}
        ids = torch.randint(3, text["vocab_size"], (1, a.large_T), generator=torch.Generator().manual_seed(SEED + 1))
        results = {}
        with tempfile.TemporaryDirectory() as folder:
            save_file(hf, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
            config = k3_config.KimiK3Config(text_config=nemo_text_config(text, torch.float32)).to_dict()
            with open(os.path.join(folder, "config.json"), "w") as f:
                json.dump(config, f)
            del hf
            rec.notes["large_build_s"] = round(time.time() - t0, 1)
            for key, backend, dtype in (("kdamoe fp32 torch", "torch", torch.float32),
                                        ("kdamoe bf16 auto", "auto", bf16)):
                if not rec.need("large", key, 30):
                    continue
                try:
                    model = load_kdamoe(folder, a.device, dtype, backend)
                    results[key] = kdamoe_logits(model, ids).float().cpu()
                    rec.notes[f"large {key} param dtypes"] = param_dtypes(model)
                    if dtype == bf16:
                        rec.notes["large kdamoe bf16 fwd ms"] = time_ms(lambda m=model: kdamoe_logits(m, ids), cuda,
                                                                        warmup=50, rep=200)
                    del model
                except Exception:
                    rec.error("large", key)
                bench.free()
        if rec.need("large", "NeMo bf16", 30):
            try:
                model = build_nemo(nemo_text_config(text, bf16), bf16)
                model = load_nemo_native(model, native, a.device)
                results["NeMo bf16"] = nemo_logits(model, ids, a.device).float().cpu()
                rec.notes["large NeMo bf16 param dtypes"] = param_dtypes(model)
                rec.notes["large NeMo bf16 fwd ms"] = time_ms(lambda m=model: nemo_logits(m, ids, a.device), cuda,
                                                              warmup=50, rep=200)
                del model
            except Exception:
                rec.error("large", "NeMo bf16")
        del nemo, native
        for ours, theirs in (("kdamoe bf16 auto", "kdamoe fp32 torch"), ("NeMo bf16", "kdamoe fp32 torch"),
                             ("kdamoe bf16 auto", "NeMo bf16")):
            if ours in results and theirs in results:
                ms = rec.notes.get(f"large {ours.removesuffix(' auto')} fwd ms")
                rec.put("large", f"{ours} vs {theirs}", {**compare(results[ours], results[theirs]), "ms": ms})

    runners = {"fixture": fixture, "large": large}
    return run_parts(bench, runners)


if __name__ == "__main__":
    sys.exit(main())
