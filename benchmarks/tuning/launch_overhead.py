"""Host time of one kernel launch: ``kdamoe.kernels.launch.FastLaunch``'s short path against Triton's own.

Each case launches one kernel on a tiny input (a few µs of GPU work, so the host is what is timed) ``--calls``
times without synchronising, and reports host µs per call (median of ``--repeats`` rounds, after one untimed round
that compiles and autotunes). Cases:

``norm_forward``
    ``kernels.norm.kernels.norm_forward`` on ``[64, 1024]`` bf16: one plain ``triton.jit`` launch and one
    ``torch.empty``.
``conv_forward``
    ``kernels.conv.forward`` via ``causal_conv1d(..., output_final_state=False)`` on ``[1, 64, 1024]`` bf16: one
    autotuned launch plus the op's own Python (validation, autograd Function).
``torch_add``
    ``torch.add`` of two ``[64, 1024]`` bf16 tensors, for scale (one ATen op, no Triton).

The short path and Triton's (``launch.set_enabled(True / False)``) run in alternating rounds in one process.

Then the dense projections' GEMMs, each under ``torch.backends.cuda.preferred_blas_library("cublas")`` and
``("cublaslt")`` in alternating rounds (a cProfile of the 8K step at ed9608d, the host part of
``e2e_h200_host_ed9608d.md``, in git history: see ``benchmarks/results/README.md``, gives the model's ``F.linear``
calls ~100 µs of own time each, cProfile's cost included):

``linear_64``
    ``F.linear`` of ``[64, 1024]`` by ``[1024, 1024]`` bf16 (host-bound: a few µs of GPU work).
``linear_64_grad``
    the same with a weight that requires grad (the autograd node recorded, as in training).
``linear_8k``
    ``F.linear`` of ``[1, 8192, 1024]`` by ``[3072, 1024]`` bf16 (the KDA layer's fused q|k|v|… shape at 8K: its
    GPU time, tens of µs, may set the pace here).

Writes ``launch_overhead.json`` into ``--out``.

    python3 benchmarks/tuning/launch_overhead.py --out "$OUT"     # on the H200
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the harness
from harness import write_json  # noqa: E402  (it puts the repo on the path)

from kdamoe.kernels import launch  # noqa: E402  (needs the repository on sys.path: harness)
from kdamoe.kernels.conv.conv import causal_conv1d  # noqa: E402  (the same)
from kdamoe.kernels.norm.kernels import norm_forward  # noqa: E402  (the same)


def cases(device):
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(64, 1024, generator=gen).to(device, torch.bfloat16)
    w = torch.randn(1024, generator=gen).to(device, torch.bfloat16)
    xc = torch.randn(1, 64, 1024, generator=gen).to(device, torch.bfloat16)
    wc = torch.randn(1024, 4, generator=gen).to(device, torch.bfloat16)
    return {
        "norm_forward": lambda: norm_forward(x, None, w, 1e-6, torch.bfloat16, torch.bfloat16),
        "conv_forward": lambda: causal_conv1d(xc, wc, output_final_state=False),
        "torch_add": lambda: torch.add(x, x),
    }


def blas_cases(device):
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(64, 1024, generator=gen).to(device, torch.bfloat16)
    w = torch.randn(1024, 1024, generator=gen).to(device, torch.bfloat16)
    wg = w.clone().requires_grad_(True)
    xl = torch.randn(1, 8192, 1024, generator=gen).to(device, torch.bfloat16)
    wl = torch.randn(3072, 1024, generator=gen).to(device, torch.bfloat16)
    F = torch.nn.functional
    return {"linear_64": lambda: F.linear(x, w), "linear_64_grad": lambda: F.linear(x, wg),
            "linear_8k": lambda: F.linear(xl, wl)}


def per_call_us(fn, calls: int) -> float:
    """Host µs per call of ``calls`` back-to-back calls (synchronised before and after, the host clock between)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host / calls * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    if a.calls < 1 or a.repeats < 1:
        p.error(f"--calls and --repeats must be >= 1 (got {a.calls}, {a.repeats})")
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    rows = []
    for name, fn in cases("cuda").items():
        times = {True: [], False: []}
        for _ in range(a.repeats + 1):
            for fast in (True, False):
                launch.set_enabled(fast)
                times[fast].append(per_call_us(fn, a.calls))
        launch.set_enabled(True)
        row = {"case": name, "fast_us": statistics.median(times[True][1:]),
               "triton_us": statistics.median(times[False][1:]),
               "fast_rounds_us": times[True][1:], "triton_rounds_us": times[False][1:]}
        rows.append(row)
        print(f"{name}: short path {row['fast_us']:.1f} µs/call, Triton's path {row['triton_us']:.1f} µs/call",
              flush=True)
    default_blas = torch.backends.cuda.preferred_blas_library()
    print(f"preferred BLAS library by default: {default_blas}", flush=True)
    blas_rows = []
    try:
        for name, fn in blas_cases("cuda").items():
            times = {"cublas": [], "cublaslt": []}
            for _ in range(a.repeats + 1):
                for lib in times:
                    torch.backends.cuda.preferred_blas_library(lib)
                    times[lib].append(per_call_us(fn, a.calls))
            row = {"case": name, **{f"{lib}_us": statistics.median(v[1:]) for lib, v in times.items()},
                   **{f"{lib}_rounds_us": v[1:] for lib, v in times.items()}}
            blas_rows.append(row)
            print(f"{name}: cublas {row['cublas_us']:.1f} µs/call, cublaslt {row['cublaslt_us']:.1f} µs/call",
                  flush=True)
    finally:
        torch.backends.cuda.preferred_blas_library(default_blas)
    os.makedirs(a.out, exist_ok=True)
    write_json(os.path.join(a.out, "launch_overhead.json"),
               {"calls": a.calls, "repeats": a.repeats, "torch": torch.__version__,
                "triton": __import__("triton").__version__, "rows": rows,
                "default_blas": str(default_blas), "blas_rows": blas_rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
