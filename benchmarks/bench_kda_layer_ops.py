"""The KDA layer's two small ops on one GPU: the short conv and the gate, in one run (bf16, median times).

(a) conv, ``x [1, T, C]`` with ``C = 3·H·K = 3072`` (q|k|v of H=8 heads of 128), width W=4, SiLU fused:
    our Triton ``kdamoe.kernels.causal_conv1d`` over all C channels, and as the KDA layer calls it
    (``causal_conv1d_parts``: one op over q|k|v writing three contiguous outputs, taking their three gradients), vs
    the PyTorch loop ``kda_torch.causal_conv1d_torch``
    (the model's CPU path) vs fla's ``fla.modules.causal_conv1d.causal_conv1d(activation="silu")`` if it imports;
    forward, and forward+backward (dx, dweight).
(b) gate, the model's KDA shape (B=1, H=8, K=V=128, L2 norm in kernel, fp32 beta): ``kda_gate`` in PyTorch
    then ``chunk_kda`` on the precomputed g, vs ``chunk_kda(use_gate_in_kernel=True)`` on the raw f;
    forward, and forward+backward (gradients of q, k, v, f, beta, dt_bias).

T ∈ {8K, 32K} (``--quick``: 8K only; ``--lengths`` picks others). Times are ``triton.testing.do_bench`` medians.
A time guard skips what would run past ``--budget-s`` (compiles included) and says so. Each section also reports
the relative L2 difference between the variants (bf16 against the float32 PyTorch result), so a fast wrong kernel
shows.

Writes ``layer_ops.json`` and ``layer_ops.md`` into ``--out`` (default ``$OUT``, else ``./bench_out``) and
prints the table. ``--smoke`` runs tiny sizes in float32 on the CPU under ``TRITON_INTERPRET=1`` (no GPU
needed; timings there mean nothing) to check the script itself.
"""

import argparse
import os
import sys
import time

if "--smoke" in sys.argv[1:]:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first @triton.jit definition

import torch  # noqa: E402  (after TRITON_INTERPRET is set for --smoke)
import triton  # noqa: E402  (the same)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import device_name, ints, kernels_only, time_ms, write_json, write_text  # noqa: E402  (sys.path above)

# kdamoe.kernels and kdamoe.model.kda_torch need torch and triton only, not kdamoe/__init__'s transformers
kernels_only()

from kdamoe.kernels import causal_conv1d, causal_conv1d_parts, chunk_kda  # noqa: E402  (after kernels_only())
from kdamoe.model.kda_torch import causal_conv1d_torch, kda_gate  # noqa: E402  (after kernels_only())


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T = 8K only, fewer repetitions")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU interpreter (checks the script)")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    parser.add_argument("--budget-s", type=float, default=220.0, help="skip what starts after this many seconds")
    parser.add_argument("--lengths", type=ints, default=None,
                        help="comma list of T (default 8192,32768; --quick: 8192; --smoke: 64,80)")
    args = parser.parse_args(argv)
    if args.lengths is not None and (not args.lengths or min(args.lengths) < 2):
        parser.error(f"--lengths must be lengths >= 2 (got {args.lengths})")
    return args


LB = -5.0
ARGS = None  # the parsed arguments, set by main
START = time.perf_counter()  # the budget's start (main resets it)


def elapsed():
    return time.perf_counter() - START


def timer(device, quick):
    """``fn -> median ms``: do_bench on CUDA, a wall-clock median on the CPU (smoke only)."""
    return lambda fn, grads=None: time_ms(fn, device == "cuda", warmup=10 if quick else 25, rep=40 if quick else 100,
                                          grads=grads)


def rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def fla_conv():
    try:
        from fla.modules.causal_conv1d import causal_conv1d as fla_causal_conv1d  # noqa: PLC0415  (fla is optional)
    except Exception as error:  # fla missing or not importable on this image
        return None, f"{type(error).__name__}: {error}"
    return fla_causal_conv1d, None


def bench_conv(T, C, W, dtype, device, measure, rows, notes):
    gen = torch.Generator(device="cpu").manual_seed(T)
    x = torch.randn(1, T, C, generator=gen).to(device, dtype).requires_grad_()
    w = (torch.randn(C, W, generator=gen) / W ** 0.5).to(device, dtype).requires_grad_()
    dy = torch.randn(1, T, C, generator=gen).to(device, dtype)
    ref, _ = causal_conv1d_torch(x.detach().float(), w.detach().float())
    fla_fn, why = fla_conv()
    if why:
        notes.add(f"fla conv not run: {why}")
    parts = [slice(i * C // 3, (i + 1) * C // 3) for i in range(3)]
    part_dys = [dy[..., p].contiguous() for p in parts]  # the KDA op hands back contiguous gradients

    def as_layer():  # the model's call: one op over q|k|v, three contiguous outputs
        return list(causal_conv1d_parts(x, w, parts=3, output_final_state=False)[0])

    variants = {
        "triton (ours)": lambda: causal_conv1d(x, w)[0],
        "triton (ours), q/k/v parts (as the layer)": as_layer,
        "torch loop": lambda: causal_conv1d_torch(x, w)[0],
    }
    if fla_fn is not None:
        variants["fla"] = lambda: fla_fn(x, weight=w, activation="silu")[0]
    for name, fn in variants.items():
        if elapsed() > ARGS.budget_s:
            rows.append(dict(op="conv", variant=name, T=T, fwd_ms=None, fwd_bwd_ms=None, err=None,
                             note="skipped (time)"))
            continue
        with torch.no_grad():
            out = fn()
            err = rel(torch.cat(out, -1) if isinstance(out, list) else out, ref)
            fwd = measure(fn)

        def step(fn=fn):
            out = fn()
            if isinstance(out, list):
                torch.autograd.backward(out, part_dys)
            else:
                out.backward(dy)

        rows.append(dict(op="conv", variant=name, T=T, fwd_ms=fwd, fwd_bwd_ms=measure(step, [x, w]), err=err, note=""))


def bench_gate(T, H, K, dtype, device, measure, rows):
    gen = torch.Generator(device="cpu").manual_seed(1000 + T)

    def mk(*s):
        return torch.randn(*s, generator=gen).to(device, dtype).requires_grad_()

    q, k, v, f = mk(1, T, H, K), mk(1, T, H, K), mk(1, T, H, K), mk(1, T, H, K)
    beta = torch.rand(1, T, H, generator=gen).to(device).requires_grad_()  # float32, as the model passes it
    dt_bias = torch.randn(H * K, generator=gen).to(device).requires_grad_()
    do = torch.randn(1, T, H, K, generator=gen).to(device, dtype)
    leaves = [q, k, v, f, beta, dt_bias]
    common = dict(use_qk_l2norm_in_kernel=True, lower_bound=LB)
    variants = {
        "kda_gate (torch) + chunk_kda": lambda: chunk_kda(q, k, v, kda_gate(f, dt_bias, LB), beta, **common)[0],
        "chunk_kda(use_gate_in_kernel)": lambda: chunk_kda(q, k, v, f, beta, use_gate_in_kernel=True, dt_bias=dt_bias,
                                                           **common)[0],
    }
    outputs = {}
    for name, fn in variants.items():
        if elapsed() > ARGS.budget_s:
            rows.append(dict(op="gate", variant=name, T=T, fwd_ms=None, fwd_bwd_ms=None, err=None,
                             note="skipped (time)"))
            continue
        with torch.no_grad():
            outputs[name] = fn()
            fwd = measure(fn)

        def step(fn=fn):
            fn().backward(do)

        rows.append(dict(op="gate", variant=name, T=T, fwd_ms=fwd, fwd_bwd_ms=measure(step, leaves), err=None, note=""))
    if len(outputs) == 2:  # the two must compute the same thing
        a, b = outputs.values()
        rows[-1]["err"] = rel(b, a)
        rows[-1]["note"] = "err: vs the torch-gate variant"


def fmt(value):
    return "—" if value is None else f"{value:.3f}"


def main(argv=None):
    global ARGS, START
    ARGS = parse_args(argv)
    START = time.perf_counter()
    cuda = torch.cuda.is_available() and not ARGS.smoke
    device = "cuda" if cuda else "cpu"
    if not cuda and not ARGS.smoke:
        sys.exit("no CUDA device: run with --smoke to check the script on the CPU interpreter")
    dtype = torch.bfloat16 if cuda else torch.float32  # the interpreter mishandles bfloat16
    H, K, W = (8, 128, 4) if not ARGS.smoke else (2, 16, 4)
    lengths = ARGS.lengths or ([64, 80] if ARGS.smoke else [8192] if ARGS.quick else [8192, 32768])
    C = 3 * H * K
    measure = timer(device, ARGS.quick)
    rows, notes = [], set()
    for T in lengths:
        bench_conv(T, C, W, dtype, device, measure, rows, notes)
        bench_gate(T, H, K, dtype, device, measure, rows)

    meta = dict(device=device_name(cuda, cpu="cpu (interpreter smoke)"), dtype=str(dtype),
                H=H, K=K, V=K, C=C, W=W, torch=torch.__version__, seconds=round(elapsed(), 1), notes=sorted(notes),
                triton=triton.__version__)
    os.makedirs(ARGS.out, exist_ok=True)
    write_json(os.path.join(ARGS.out, "layer_ops.json"), dict(meta=meta, rows=rows))
    header = "| op | variant | T | fwd ms | fwd+bwd ms | rel. L2 diff | note |\n|---|---|---|---|---|---|---|\n"
    body = "".join(f"| {r['op']} | {r['variant']} | {r['T']} | {fmt(r['fwd_ms'])} | {fmt(r['fwd_bwd_ms'])} | "
                   f"{'—' if r['err'] is None else format(r['err'], '.2e')} | {r['note']} |\n"
                   for r in rows)
    text = (f"# KDA layer ops ({meta['device']}, {meta['dtype']})\n\n"
            f"B=1, H={H}, K=V={K}; conv C={C}, W={W}. Medians of triton.testing.do_bench. rel. L2 diff: against the "
            f"float32 PyTorch conv (conv rows) or between the two gate variants (gate rows).\n\n" + header + body
            + "".join(f"\n- {n}" for n in meta["notes"]) + f"\n\nTotal run time {meta['seconds']} s.\n")
    write_text(os.path.join(ARGS.out, "layer_ops.md"), text)
    print(text)


if __name__ == "__main__":
    main()
