"""MoE kernels on one GPU: bf16 correctness against float32, then fwd / fwd+bwd timings against peers.

Usage (device): ``PYTHONPATH=$PWD python3 benchmarks/bench_moe.py [--quick]``; writes
``$OUT/moe_h200.json`` and ``$OUT/moe_h200.md`` (copied to ``benchmarks/results/``).
Ours = ``moe_route`` (+ QB histogram off) + ``moe_experts``; peer = ``moe_peers.grouped_mm_moe``
(sigmoid + top-k, argsort permutation, two ``torch._grouped_mm``, SiTU, weighted combine, autograd);
loop = ``moe_peers.loop_moe``. FLOPs: 6·N·k·ℓ·I forward, 18·N·k·ℓ·I forward+backward.
"""

import json
import os
import sys
import time

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_peers import grouped_mm_moe, loop_experts, loop_moe  # noqa: E402

from kdamoe.kernels import moe_experts, moe_route  # noqa: E402

CEIL = 757.0  # TFLOP/s, bf16 GEMM 8192³ on this H200 (DESIGN.md §4)
dev = "cuda"
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
OUT = os.environ.get("OUT", ".")
QUICK = "--quick" in sys.argv
LOG = []


def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    LOG.append(s)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make(n, hid, inter, e, seed, skew=0.0):
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(n, hid, device=dev, generator=g).bfloat16()
    w1 = (torch.randn(e, 2 * inter, hid, device=dev, generator=g) * hid ** -0.5).bfloat16()
    w2 = (torch.randn(e, hid, inter, device=dev, generator=g) * inter ** -0.5).bfloat16()
    logits = torch.randn(n, e, device=dev, generator=g)
    if skew:
        logits = logits + skew * torch.randn(e, device=dev, generator=g)
    bias = (torch.randn(e, device=dev, generator=g) * 0.01).float()
    return x, w1, w2, logits.bfloat16(), bias


def correctness(n, hid, inter, e, k, seed, drop=0.0):
    x, w1, w2, logits, bias = make(n, hid, inter, e, seed)
    r = moe_route(logits, bias, k)
    idx = r.top_k_index.clone()
    if drop:
        gen = torch.Generator(device=dev).manual_seed(seed + 1)
        idx[torch.rand(idx.shape, device=dev, generator=gen) < drop] = e
    wts = r.top_k_weights.detach().bfloat16()
    ps = [t.clone().requires_grad_() for t in (x, wts, w1, w2)]
    out = moe_experts(ps[0], idx, ps[1], ps[2], ps[3])
    dout = torch.randn_like(out)
    out.backward(dout)
    qs = [t.detach().float().requires_grad_() for t in (x, wts, w1, w2)]
    ref = loop_experts(qs[0], idx, qs[1], qs[2], qs[3])
    ref.backward(dout.float())
    errs = {"out": rel(out, ref)}
    for name, p, q in zip(["d_hidden", "d_weights", "d_gate_up", "d_down"], ps, qs):
        errs[name] = rel(p.grad, q.grad)
    # routing: same picks as a float32 torch router, weights close
    s = torch.sigmoid(logits.float())
    ridx = torch.topk(s + bias, k, dim=-1).indices
    errs["route_idx_mismatch"] = (ridx != r.top_k_index).float().mean().item()
    sel = s.gather(1, ridx)
    errs["route_w"] = rel(r.top_k_weights, sel / sel.sum(-1, keepdim=True))
    return errs


def bench(fn, grads, rep):
    return do_bench(fn, warmup=max(25, rep // 4), rep=rep, grad_to_none=grads, return_mode="median")


def timing(name, n, hid, inter, e, k, skew, with_loop):
    x, w1, w2, logits, bias = make(n, hid, inter, e, 1234, skew)
    load = torch.bincount(torch.topk(torch.sigmoid(logits.float()) + bias, k, -1).indices.flatten(), minlength=e)
    ps = [t.clone().requires_grad_() for t in (x, w1, w2, logits)]
    dout = torch.randn(n, hid, device=dev, dtype=torch.bfloat16)

    def ours():
        r = moe_route(ps[3], bias, k)
        return moe_experts(ps[0], r.top_k_index, r.top_k_weights, ps[1], ps[2])

    def peer():
        return grouped_mm_moe(ps[0], ps[3], bias, ps[1], ps[2], k)

    def loop():
        return loop_moe(ps[0], ps[3], bias, ps[1], ps[2], k)

    m = n * k
    ff, fb = 6 * m * hid * inter, 18 * m * hid * inter
    rows = []
    cands = [("ours", ours), ("peer", peer)] + ([("loop", loop)] if with_loop else [])
    t = {}
    for cname, f in cands:
        rep = 100 if cname != "loop" else 60
        with torch.no_grad():
            t[cname, "fwd"] = bench(f, None, rep)
        t[cname, "fwdbwd"] = bench(lambda: f().backward(dout), ps, rep)
    # breakdown of ours
    with torch.no_grad():
        t_route = bench(lambda: moe_route(ps[3], bias, k), None, 50)
        r = moe_route(ps[3], bias, k)
        t_exp = bench(lambda: moe_experts(ps[0], r.top_k_index, r.top_k_weights, ps[1], ps[2]), None, 50)
    log(f"{name}: load max/mean {load.max().item() / load.float().mean().item():.2f} min {load.min().item()}; "
        f"route {t_route:.3f} ms, experts fwd {t_exp:.3f} ms")
    for mode, fl in (("fwd", ff), ("fwdbwd", fb)):
        row = {"name": f"{name}_{mode}", "ours_ms": round(t["ours", mode], 4), "peer": "torch._grouped_mm pipeline",
               "peer_ms": round(t["peer", mode], 4), "ratio": round(t["ours", mode] / t["peer", mode], 4),
               "loop_ms": round(t["loop", mode], 4) if with_loop else None,
               "ours_tflops": round(fl / t["ours", mode] / 1e9, 1), "peer_tflops": round(fl / t["peer", mode] / 1e9, 1),
               "ours_frac_of_757": round(fl / t["ours", mode] / 1e9 / CEIL, 3)}
        rows.append(row)
        log(json.dumps(row))
    del ps, x, w1, w2, logits
    torch.cuda.empty_cache()
    return rows


def profile(name, n, hid, inter, e, k):
    """Per-kernel CUDA time of one forward+backward of ours (torch.profiler), printed to the log."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprof
    x, w1, w2, logits, bias = make(n, hid, inter, e, 1234)
    ps = [t.clone().requires_grad_() for t in (x, w1, w2, logits)]
    dout = torch.randn(n, hid, device=dev, dtype=torch.bfloat16)

    def step():
        r = moe_route(ps[3], bias, k)
        moe_experts(ps[0], r.top_k_index, r.top_k_weights, ps[1], ps[2]).backward(dout)

    step()
    torch.cuda.synchronize()
    with tprof(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    try:
        tab = prof.key_averages().table(sort_by="device_time_total", row_limit=14, max_name_column_width=48)
    except Exception:  # older key name
        tab = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=48)
    log(f"profile {name} (one fwd+bwd):")
    log(tab)


def main():
    import triton
    log("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(),
        "has _grouped_mm", hasattr(torch, "_grouped_mm"))
    t0 = time.time()
    errs = {}
    # same (ℓ, I, k, block) as the timed cases, so the autotuned kernels are shared; slots dropped to E (EP)
    for cfg in [(4096, 2048, 512, 128, 8, 0, 0.1), (12288, 2048, 256, 512, 8, 1, 0.0),
                (12288, 2048, 384, 896, 16, 2, 0.1)]:
        n, hid, inter, e, k, seed, drop = cfg
        ee = correctness(n, hid, inter, e, k, seed, drop)
        errs[str(cfg)] = ee
        log("correctness", cfg, {a: round(b, 5) for a, b in ee.items()})
    log(f"correctness took {time.time() - t0:.1f}s")
    ok = all(v <= 1e-2 for ee in errs.values() for kk, v in ee.items() if kk != "route_idx_mismatch")
    log("bf16 within 1e-2:", ok)
    cases = [("E128_I512_k8", 16384, 2048, 512, 128, 8, 0.0), ("E512_I256_k8", 16384, 2048, 256, 512, 8, 0.0),
             ("E896_I384_k16", 16384, 2048, 384, 896, 16, 0.0), ("E128_I512_k8_skewed", 16384, 2048, 512, 128, 8, 1.0)]
    if QUICK:
        cases = cases[:3]
    rows = []
    for name, n, hid, inter, e, k, skew in cases:
        t1 = time.time()
        rows += timing(name, n, hid, inter, e, k, skew, with_loop=not QUICK)
        log(f"{name} took {time.time() - t1:.1f}s")
        json.dump(rows, open(os.path.join(OUT, "moe_h200.json"), "w"), indent=1)
    for name, n, hid, inter, e, k, skew in cases[:3]:
        profile(name, n, hid, inter, e, k)
    json.dump(errs, open(os.path.join(OUT, "moe_h200_errors.json"), "w"), indent=1)
    md = ["| case | ours ms | grouped_mm ms | loop ms | ours/peer | ours TFLOP/s | peer TFLOP/s | ours % of 757 |",
          "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['name']} | {r['ours_ms']:.3f} | {r['peer_ms']:.3f} | "
                  f"{r['loop_ms'] if r['loop_ms'] is None else round(r['loop_ms'], 3)} | {r['ratio']:.3f} | "
                  f"{r['ours_tflops']} | {r['peer_tflops']} | {100 * r['ours_frac_of_757']:.1f} |")
    md.append("")
    md.append("bf16 relative L2 errors vs float32 reference: ")
    for c, ee in errs.items():
        md.append(f"- {c}: " + ", ".join(f"{a} {b:.2e}" for a, b in ee.items()))
    open(os.path.join(OUT, "moe_h200.md"), "w").write("\n".join(md) + "\n")
    open(os.path.join(OUT, "moe_bench_log.txt"), "w").write("\n".join(LOG) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
