"""One KDA layer with Kimi Linear's unbounded gate: kdamoe's layer vs transformers' ``KimiLinearDeltaAttention``.

The layer at Kimi-Linear-48B widths (hidden 2304, 32 heads × 128, short conv 4), bf16 weights (``dt_bias`` and
``A_log`` float32, as a loaded model keeps them), options ``kda_lower_bound=None, kda_use_A_log=True,
kda_output_gate_bias=False``. Both layers hold the same weights, so each row also gives the relative L2 difference of
their outputs. Parts:

* ``train``: forward + backward (gradients of the input and of every weight), batch 1, ``T`` in ``--lengths``
  (default 4K, 16K);
* ``decode``: one token on a cache holding ``--state`` tokens (default 4K), batch ``--batches`` (default 1, 16); the
  cache is filled by one prefill of each layer, then the step is timed repeatedly on it (the state grows by one token
  per call, which changes no cost).

Variants: kdamoe with ``kernel_backend="auto"`` (the unbounded gate runs fla's ``chunk_kda`` /
``fused_recurrent_kda`` with the gate inside fla's kernel; the short conv and the gated norm are kdamoe's Triton
kernels), kdamoe with ``kernel_backend="fla"`` (fla's conv too, the norm in PyTorch), and the native layer
(transformers computes the gate in PyTorch, then calls the fla ops it bound at import time through
``use_kernel_func_from_hub_with_fallback``: fla must import before transformers' ``kimi_linear`` module does; the
stack entry ``native_kda_from`` says what it bound). Times are ``triton.testing.do_bench`` medians.

Writes ``kimi_linear_gate.json`` / ``.md`` into ``--out`` after every measurement. ``--tiny --device cpu`` runs toy
sizes in float32 on the CPU (the PyTorch paths of both) to check the script; its times mean nothing.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (  # noqa: E402  (sys.path above)
    PartBench,
    Recorder,
    add_run_args,
    check_at_least,
    finish_run_args,
    fmt,
    implementation_module,
    ints,
    label,
    run_parts,
    stack_versions,
    time_ms,
)

PARTS = ("train", "decode")
FULL = dict(hidden=2304, heads=32, head_dim=128, conv=4)
TINY_SIZES = dict(hidden=64, heads=2, head_dim=16, conv=4)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(p, PARTS, out_default="bench_out", out_help="folder of kimi_linear_gate.json / .md",
                 budget_default=400.0)
    p.add_argument("--lengths", type=ints, default=None, help="train lengths (default 4096,16384; --tiny: 64,80)")
    p.add_argument("--state", type=int, default=None, help="tokens in the cache before a decode step (4096; tiny 40)")
    p.add_argument("--batches", type=ints, default=None, help="decode batch sizes (default 1,16; --tiny: 1,2)")
    a = finish_run_args(p, p.parse_args(argv), PARTS, {})
    a.lengths = a.lengths or ([64, 80] if a.tiny else [4096, 16384])
    a.batches = a.batches or ([1, 2] if a.tiny else [1, 16])
    a.state = a.state if a.state is not None else (40 if a.tiny else 4096)
    if not a.lengths or not a.batches:
        p.error("--lengths and --batches must name at least one value")
    a.min_length, a.min_batch = min(a.lengths), min(a.batches)
    check_at_least(p, a, ("min_length", "state"), 2)
    check_at_least(p, a, ("min_batch",), 1)
    return a


class GateRecorder(Recorder):
    stem = "kimi_linear_gate"
    strip_paths = True

    def rows(self) -> list[dict]:
        rows = []
        for group, entries in self.raw.items():
            if group not in PARTS:
                continue
            for key, entry in entries.items():
                if isinstance(entry, dict) and "ms" in entry:
                    rows.append({"part": group, "case": key, **entry})
        return rows

    def markdown(self, doc: dict) -> str:
        s = doc["settings"]
        lines = [f"# One KDA layer, Kimi Linear's unbounded gate ({doc['stack'].get('gpu', '?')}, {s.get('dtype')})",
                 "", f"hidden {s.get('hidden')}, {s.get('heads')} heads × {s.get('head_dim')}, conv {s.get('conv')}; "
                 f"native KDA ops from: {doc['stack'].get('native_kda_ops')}; fla {doc['stack'].get('fla')}.", "",
                 "| part | case | ms | vs native | rel. L2 diff to native |", "|---|---|---|---|---|"]
        native = {(r["part"], r["case"].split(" / ")[0]): r["ms"] for r in doc["rows"] if r["case"].endswith("native")}
        for r in doc["rows"]:
            peer = native.get((r["part"], r["case"].split(" / ")[0]))
            ratio = r["ms"] / peer if peer and not r["case"].endswith("native") else None
            lines.append(f"| {r['part']} | {r['case']} | {fmt(r['ms'])} | {fmt(ratio)} | {fmt(r.get('rel_diff'))} |")
        for group, entries in doc["raw"].items():
            for key, entry in entries.items():
                if not (isinstance(entry, dict) and "ms" in entry):
                    lines.append(f"- {group}/{key}: {entry}")
        return "\n".join(lines) + "\n"


def build_pair(sizes, device, dtype, kernel_backend):
    """kdamoe's KDA layer (``kernel_backend``) and transformers' with the same seeded weights."""
    from transformers import KimiLinearConfig  # noqa: PLC0415  (after fla is importable: transformers binds it then)
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention  # noqa: PLC0415

    from kdamoe import KDAMoEConfig  # noqa: PLC0415  (imports transformers too)
    from kdamoe.model.modeling_kdamoe import KDAMoEDeltaAttention  # noqa: PLC0415

    d, H, K, W = sizes["hidden"], sizes["heads"], sizes["head_dim"], sizes["conv"]
    config = KDAMoEConfig(hidden_size=d, kda_num_heads=H, kda_head_dim=K, kda_short_conv_kernel_size=W,
                          num_attention_heads=H, layer_types=["linear_attention"], num_hidden_layers=1,
                          first_k_dense_replace=1, attnres_num_blocks=0, hidden_act="silu", kda_lower_bound=None,
                          kda_use_A_log=True, kda_output_gate_bias=False, kernel_backend=kernel_backend)
    ours = KDAMoEDeltaAttention(config, layer_idx=0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name == "A_log":
                p.copy_(torch.empty(H).uniform_(1, 16, generator=gen).log())
            elif name == "dt_bias":
                p.copy_(torch.randn(p.shape, generator=gen) - 4)
            elif name == "o_norm.weight":
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1] if p.dim() > 1 and name != "conv1d.weight" else W
                p.copy_(torch.randn(p.shape, generator=gen) / fan_in ** 0.5)
    native_config = KimiLinearConfig(hidden_size=d, linear_num_heads=H, linear_head_dim=K, linear_conv_kernel_dim=W,
                                     hidden_act="silu", rms_norm_eps=config.rms_norm_eps, num_hidden_layers=1,
                                     layer_types=["linear_attention"], pad_token_id=None, bos_token_id=None,
                                     eos_token_id=None)
    native = KimiLinearDeltaAttention(native_config, layer_idx=0)
    own = dict(ours.named_parameters())
    with torch.no_grad():
        for name, p in native.named_parameters():
            p.copy_(own[name.removeprefix("forget_gate.")].view(p.shape))
    keep_fp32 = ("dt_bias", "A_log")
    for layer in (ours, native):
        layer.to(device)
        for name, p in layer.named_parameters():
            if not name.endswith(keep_fp32):
                p.data = p.data.to(dtype)
    return config, ours.eval(), native_config, native.eval()


def native_binding() -> dict:
    """What transformers' KimiLinear bound for its KDA ops (``fla.ops.kda.…`` or its torch fallback). transformers 5.25
    wraps the 5.24-style wrapper that :func:`harness.implementation_module` reads in a module whose ``forward`` closes
    over it as ``func``; both forms are read."""
    from transformers.models.kimi_linear import modeling_kimi_linear as kl  # noqa: PLC0415  (after fla, see build_pair)

    found = {}
    for name in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"):
        fn = getattr(kl, name)
        forward = getattr(fn, "forward", None)
        if "func" in getattr(getattr(forward, "__code__", None), "co_freevars", ()):
            cells = dict(zip(forward.__code__.co_freevars, forward.__closure__, strict=True))
            fn = cells["func"].cell_contents
        found[name] = implementation_module(fn)
    return found


def rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main(argv=None):
    a = parse_args(argv)
    cuda = a.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    sizes = TINY_SIZES if a.tiny else FULL
    os.makedirs(a.out, exist_ok=True)
    if a.tiny and not cuda:
        torch.set_num_threads(1)
    rec = GateRecorder(a.out, a.budget_s, {"tiny": a.tiny, "dtype": str(dtype), **sizes, "lengths": a.lengths,
                                           "state": a.state, "batches": a.batches})
    rec.stack = {**stack_versions(cuda), "native_kda_ops": native_binding()}
    rec.save()
    measure = lambda fn, grads=None: time_ms(fn, cuda, grads=grads)  # noqa: E731  (one-line timer)
    gen = torch.Generator().manual_seed(1)
    layers = {}
    # kernel_backend="fla" needs CUDA tensors: the CPU smoke run has the two PyTorch paths only.
    variants = ("native", "kdamoe auto", "kdamoe fla") if cuda else ("native", "kdamoe auto")

    def pair(backend):
        if backend not in layers:
            layers[backend] = build_pair(sizes, a.device, dtype, backend)
        return layers[backend]

    def train():
        for T in a.lengths:
            x = torch.randn(1, T, sizes["hidden"], generator=gen).to(a.device, dtype)
            dy = torch.randn(1, T, sizes["hidden"], generator=gen).to(a.device, dtype)
            outputs = {}
            for variant in variants:
                key = f"T={label(T)} / {variant}"
                if not rec.need("train", key, 20):
                    continue
                try:
                    _, ours, _, native = pair("fla" if variant == "kdamoe fla" else "auto")
                    layer = native if variant == "native" else ours
                    xg = x.clone().requires_grad_()
                    with torch.no_grad():
                        outputs[variant] = layer(x)
                    leaves = [xg, *layer.parameters()]
                    ms = measure(lambda layer=layer, xg=xg, dy=dy: layer(xg).backward(dy), leaves)
                    diff = None if variant == "native" else rel(outputs[variant], outputs["native"])
                    rec.put("train", key, {"ms": ms, "rel_diff": diff})
                except Exception:
                    rec.error("train", key)
                if cuda:
                    torch.cuda.empty_cache()

    def decode():
        from transformers import DynamicCache  # noqa: PLC0415  (see build_pair)

        from kdamoe import KDAMoECache  # noqa: PLC0415

        for B in a.batches:
            prompt = torch.randn(B, a.state, sizes["hidden"], generator=gen).to(a.device, dtype)
            step = torch.randn(B, 1, sizes["hidden"], generator=gen).to(a.device, dtype)
            outputs = {}
            for variant in variants:
                key = f"B={B}, state {label(a.state)} / {variant}"
                if not rec.need("decode", key, 20):
                    continue
                try:
                    config, ours, native_config, native = pair("fla" if variant == "kdamoe fla" else "auto")
                    with torch.no_grad():
                        if variant == "native":
                            layer, cache = native, DynamicCache(config=native_config)
                        else:
                            layer, cache = ours, KDAMoECache(config)
                        layer(prompt, cache=cache)
                        outputs[variant] = layer(step, cache=cache)  # the step measured below, on a state one longer
                        ms = measure(lambda layer=layer, cache=cache, step=step: layer(step, cache=cache))
                    diff = None if variant == "native" else rel(outputs[variant], outputs["native"])
                    rec.put("decode", key, {"ms": ms, "rel_diff": diff})
                except Exception:
                    rec.error("decode", key)
                if cuda:
                    torch.cuda.empty_cache()

    bench = PartBench(a, rec, cuda)

    runners = {"train": train, "decode": decode}
    return run_parts(bench, runners)


if __name__ == "__main__":
    sys.exit(main())
