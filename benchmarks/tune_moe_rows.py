"""Block-size sweep of the routed experts' grouped GEMM kernels at one model shape (one GPU).

    python benchmarks/tune_moe_rows.py [--tokens 32768] [--experts 64] [--latent 1024] [--inter 512] [--top-k 8]
    TRITON_INTERPRET=1 python benchmarks/tune_moe_rows.py --smoke     # CPU check of the runner only

For each GEMM that ``kdamoe.kernels.moe.experts.MoEExpertsFunction`` launches (forward gate/up, forward down,
backward ∂h with the GLU derivative, backward ∂x, the two weight gradients) it times every candidate block
configuration on the same inputs (``triton.testing.do_bench``, median) and reports ms, TFLOP/s, registers and
spills per thread, and whether the PTX holds ``wgmma`` (Hopper's warpgroup MMA; without it the GEMM is on a slower
path). Writes ``moe_rows_tune.{json,md}`` into ``--out`` ($OUT). The kernels' autotune lists are chosen from it
(benchmarks/notes_moe.md).

Routing: each token picks ``top_k`` distinct experts uniformly at random (fixed seed), so experts hold about
``tokens·top_k/experts`` rows each, as a balanced router gives.
"""

import argparse
import json
import os
import sys

import torch
import triton

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from kdamoe.kernels.moe import grouped_gemm as gg  # noqa: E402
from kdamoe.kernels.moe.activation import ACTIVATIONS  # noqa: E402
from kdamoe.kernels.moe.experts import _Plan  # noqa: E402
from kdamoe.kernels.moe.permute import tile_offsets  # noqa: E402

# (BN, BK, num_warps, num_stages) for the row GEMMs and gate/up; (BP, BQ, BK, warps, stages) for wgrad
ROW_CFGS = [(128, 64, 8, 4), (128, 32, 4, 4), (64, 64, 4, 4), (64, 64, 8, 4), (128, 64, 8, 3), (256, 64, 8, 3),
            (128, 128, 8, 3)]
WGRAD_CFGS = [(128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 256, 64, 8, 3),
              (256, 128, 64, 8, 3), (128, 128, 32, 8, 4)]
BMS = (128, 256)


def _plan(idx, e, bm):
    plan = _Plan(idx, e)
    plan.bm = bm
    counts = plan.row_offs[1:] - plan.row_offs[:-1]
    plan.tile_offs = tile_offsets(counts, bm)
    plan.max_tiles = triton.cdiv(plan.m, bm) + e
    tiles = torch.arange(plan.max_tiles, device=idx.device, dtype=torch.int32)
    plan.tile_expert = torch.searchsorted(plan.tile_offs[1:], tiles, right=True).to(torch.int32)
    return plan


def _info(compiled):
    ptx = compiled.asm.get("ptx", "") if hasattr(compiled, "asm") else ""
    return {"regs": getattr(compiled, "n_regs", None), "spills": getattr(compiled, "n_spills", None),
            "wgmma": ("wgmma" in ptx) if ptx else None}


def _time(fn, smoke):
    if smoke:
        fn()
        return float("nan")
    from triton.testing import do_bench
    return do_bench(fn, warmup=10, rep=40, return_mode="median")


def _measure(row: dict, launch, flops: int, smoke: bool) -> dict:
    """``row`` with the compiled kernel's resources, its median ms and TFLOP/s; a config that does not compile
    (shared memory) is recorded with its error, not fatal."""
    try:
        row.update(_info(launch()))
        ms = _time(launch, smoke)
        row.update(ms=ms, tflops=flops / ms / 1e9 if ms == ms else None)
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    print(json.dumps(row), flush=True)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--latent", type=int, default=1024, help="ℓ: the experts' input/output width")
    p.add_argument("--inter", type=int, default=512, help="I: the experts' intermediate width")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, first configs only (CPU interpreter)")
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    a = p.parse_args()
    if a.smoke:
        a.tokens, a.experts, a.latent, a.inter, a.top_k = 64, 4, 64, 32, 2
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    prec = "tf32" if dt != torch.float32 else "ieee"
    g = torch.Generator(device="cpu").manual_seed(0)
    n, e, L, inter, k = a.tokens, a.experts, a.latent, a.inter, a.top_k
    idx = torch.rand(n, e, generator=g).argsort(-1)[:, :k].to(torch.int32).to(dev)
    w = torch.rand(n, k, generator=g).to(dev)
    x = (torch.randn(n, L, generator=g) * 0.5).to(dt).to(dev)
    w1 = (torch.randn(e, 2 * inter, L, generator=g) * L ** -0.5).to(dt).to(dev)
    w2 = (torch.randn(e, L, inter, generator=g) * inter ** -0.5).to(dt).to(dev)
    m = n * k
    gbuf = torch.randn(m, inter, device=dev).to(dt)
    h = torch.randn(m, 2 * inter, device=dev).to(dt)
    dout = torch.randn(n, L, device=dev).to(dt)
    dh = torch.randn(m, 2 * inter, device=dev).to(dt)
    y = torch.empty(m, L, device=dev, dtype=dt)
    gout = torch.empty(m, inter, device=dev, dtype=dt)
    hout = torch.empty(m, 2 * inter, device=dev, dtype=dt)
    dw = torch.zeros(m, device=dev, dtype=torch.float32)
    dummy = torch.zeros(1, device=dev, dtype=torch.float32)
    act = ACTIVATIONS["situ"]
    rows_fn = gg._rows_gemm_kernel.fn if hasattr(gg._rows_gemm_kernel, "fn") else gg._rows_gemm_kernel
    gu_fn = gg._gate_up_fwd_kernel.fn if hasattr(gg._gate_up_fwd_kernel, "fn") else gg._gate_up_fwd_kernel
    wg_fn = gg._wgrad_kernel.fn if hasattr(gg._wgrad_kernel, "fn") else gg._wgrad_kernel
    flops = {"gate_up": 2 * m * L * 2 * inter, "down": 2 * m * inter * L, "dglu": 2 * m * L * inter,
             "dx": 2 * m * 2 * inter * L, "dw1": 2 * m * 2 * inter * L, "dw2": 2 * m * L * inter}
    rows = []
    row_cfgs = ROW_CFGS[:1] if a.smoke else ROW_CFGS
    bms = BMS[:1] if a.smoke else BMS
    for bm in bms:
        plan = _plan(idx, e, bm)
        common = (plan.order, plan.tile_expert, plan.tile_offs, plan.row_offs)
        for bn, bk, nw, ns in row_cfgs:
            if bm * bn > 128 * 256:
                continue
            launches = {
                "gate_up": lambda: gu_fn[(plan.max_tiles * triton.cdiv(inter, bn),)](
                    x, w1, *common, gout, hout, e, inter, L, k, 4.0, 25.0, ACT=act, SAVE_H=True, PREC=prec,
                    BM=bm, BN=bn, BK=bk, num_warps=nw, num_stages=ns),
                "down": lambda: rows_fn[(plan.max_tiles * triton.cdiv(L, bn),)](
                    gbuf, w2, *common, y, w, dummy, dummy, e, L, inter, k, inter, L * inter, 1, inter, 4.0, 25.0,
                    GATHER_A=False, SCALE=True, EPILOGUE=0, ACT=act, PREC=prec, BM=bm, BN=bn, BK=bk,
                    num_warps=nw, num_stages=ns),
                "dglu": lambda: rows_fn[(plan.max_tiles * triton.cdiv(inter, bn),)](
                    dout, w2, *common, hout, w, h, dw, e, inter, L, k, L, L * inter, inter, 1, 4.0, 25.0,
                    GATHER_A=True, SCALE=False, EPILOGUE=1, ACT=act, PREC=prec, BM=bm, BN=bn, BK=bk,
                    num_warps=nw, num_stages=ns),
                "dx": lambda: rows_fn[(plan.max_tiles * triton.cdiv(L, bn),)](
                    dh, w1, *common, y, w, dummy, dummy, e, L, 2 * inter, k, 2 * inter, 2 * inter * L, L, 1,
                    4.0, 25.0, GATHER_A=False, SCALE=False, EPILOGUE=0, ACT=act, PREC=prec, BM=bm, BN=bn, BK=bk,
                    num_warps=nw, num_stages=ns),
            }
            for name, fn in launches.items():
                rows.append(_measure({"gemm": name, "BM": bm, "BN": bn, "BK": bk, "warps": nw, "stages": ns}, fn,
                                     flops[name], a.smoke))
    plan = _plan(idx, e, 64)
    experts = torch.arange(e, device=dev, dtype=torch.int32)
    dw1 = torch.empty_like(w1)
    dw2 = torch.empty_like(w2)
    for bp, bq, bk, nw, ns in (WGRAD_CFGS[:1] if a.smoke else WGRAD_CFGS):
        launches = {
            "dw1": lambda: wg_fn[(e * triton.cdiv(2 * inter, bp) * triton.cdiv(L, bq),)](
                dh, x, plan.order, plan.row_offs, experts, w, dw1, e, 2 * inter, L, k, 2 * inter, L,
                GATHER_A=False, GATHER_B=True, SCALE_A=False, PREC=prec, BP=bp, BQ=bq, BK=bk, num_warps=nw,
                num_stages=ns),
            "dw2": lambda: wg_fn[(e * triton.cdiv(L, bp) * triton.cdiv(inter, bq),)](
                dout, gbuf, plan.order, plan.row_offs, experts, w, dw2, e, L, inter, k, L, inter,
                GATHER_A=True, GATHER_B=False, SCALE_A=True, PREC=prec, BP=bp, BQ=bq, BK=bk, num_warps=nw,
                num_stages=ns),
        }
        for name, fn in launches.items():
            rows.append(_measure({"gemm": name, "BP": bp, "BQ": bq, "BK": bk, "warps": nw, "stages": ns}, fn,
                                 flops[name], a.smoke))
    os.makedirs(a.out, exist_ok=True)
    shape = {"tokens": n, "experts": e, "latent": L, "inter": inter, "top_k": k, "dtype": str(dt),
             "torch": torch.__version__, "triton": triton.__version__,
             "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"}
    with open(os.path.join(a.out, "moe_rows_tune.json"), "w") as f:
        json.dump({"shape": shape, "rows": rows}, f, indent=1)
    lines = [f"# Grouped GEMM sweep: {shape}", "", "| gemm | config | ms | TFLOP/s | regs | spills | wgmma |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["gemm"], r.get("ms") or 1e9)):
        cfg = " ".join(f"{key}{r[key]}" for key in ("BM", "BN", "BP", "BQ", "BK", "warps", "stages") if key in r)
        ms = r.get("ms")
        tf = r.get("tflops")
        lines.append(f"| {r['gemm']} | {cfg} | {'' if ms is None else f'{ms:.3f}'} | "
                     f"{'' if tf is None else f'{tf:.0f}'} | {r.get('regs')} | {r.get('spills')} | "
                     f"{r.get('wgmma')} {r.get('error', '')} |")
    with open(os.path.join(a.out, "moe_rows_tune.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
