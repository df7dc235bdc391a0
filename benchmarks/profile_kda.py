"""Per-kernel GPU time of chunked KDA, ours and fla's, from one torch.profiler trace each.

Answers "which stage loses the time" for both implementations in the same process: for each
implementation, length and mode (forward; forward+backward) it warms up, profiles ``--iters`` calls
and prints the summed device time of every kernel name divided by the number of calls.

    PYTHONPATH=$PWD python3 benchmarks/profile_kda.py --lengths 32768,131072 --out $OUT

Same call as bench_kda.py: B=1, H=16, K=V=128, bf16, gate and L2 norm in the kernel, lower bound −5.
Writes ``kda_profile.json`` ({impl: {case: {kernel: ms per call}}}) into ``--out``.
"""

import argparse
import json
import os
import sys
import traceback
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kda import LB, kernels_without_model_registry  # noqa: E402


def kernel_times(fn, iters):
    """{kernel name: device ms per call of ``fn``}, from a torch.profiler trace of ``iters`` calls."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    acc = defaultdict(float)
    for evt in prof.key_averages():
        t = getattr(evt, "self_device_time_total", None)
        if t is None:
            t = getattr(evt, "self_cuda_time_total", 0.0)
        if t > 0:
            acc[evt.key[:90]] += t / 1e3 / iters
    return dict(sorted(acc.items(), key=lambda kv: -kv[1]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT") or ".")
    ap.add_argument("--lengths", default="32768,131072")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--impls", default="ours,fla", help="comma list of ours, fla")
    args = ap.parse_args()
    kernels_without_model_registry()
    impls = {}
    if "ours" in args.impls:
        from kdamoe.kernels import chunk_kda
        impls["ours"] = chunk_kda
    if "fla" in args.impls:
        try:
            from fla.ops.kda import chunk_kda as fla_chunk
            impls["fla"] = fla_chunk
        except Exception:
            traceback.print_exc()
    H, D, dev = 16, 128, "cuda"
    result = defaultdict(dict)
    for T in [int(x) for x in args.lengths.split(",")]:
        torch.manual_seed(0)
        mk = lambda: torch.randn(1, T, H, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        q, k, v, f = mk(), mk(), mk(), mk()
        beta = torch.rand(1, T, H, device=dev, dtype=torch.bfloat16).requires_grad_(True)
        dtb = torch.zeros(H * D, device=dev)
        do = torch.randn_like(v)
        kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=None, dt_bias=dtb, safe_gate=True,
                  lower_bound=LB)
        for name, fn in impls.items():
            fwd = lambda fn=fn: fn(q, k, v, f, beta, **kw)[0]

            def fwdbwd(fwd=fwd):
                fwd().backward(do)
            for mode, call in (("fwd", fwd), ("fwdbwd", fwdbwd)):
                try:
                    times = kernel_times(call, args.iters)
                except Exception:
                    traceback.print_exc()
                    continue
                case = f"{mode}_T{T // 1024}K"
                result[name][case] = times
                print(f"\n== {name} {case}: total {sum(times.values()):.3f} ms", flush=True)
                for kname, ms in times.items():
                    if ms >= 0.005:
                        print(f"  {ms:8.3f}  {kname}")
        del q, k, v, f, beta, do
        torch.cuda.empty_cache()
    try:  # which autotune config our kernels picked
        from kdamoe.kernels.kda import backward, intra, prepare, state
        for mod in (prepare, intra, state, backward):
            for attr in dir(mod):
                obj = getattr(mod, attr)
                if hasattr(obj, "best_config") and getattr(obj, "cache", None):
                    for key_, cfg in obj.cache.items():
                        print("autotune", attr, str(cfg), "key dtypes", [x for x in key_ if "float16" in str(x)][:2])
    except Exception:
        traceback.print_exc()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"kda_profile_{'_'.join(impls)}.json"), "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
