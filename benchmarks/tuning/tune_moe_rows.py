"""Block-size sweep of the routed experts' kernels at one model shape (one GPU).

    python benchmarks/tune_moe_rows.py [--tokens 32768] [--experts 64] [--latent 1024] [--inter 512] [--top-k 8]
                                       [--budget-s 140]
    TRITON_INTERPRET=1 python benchmarks/tune_moe_rows.py --smoke     # CPU check of the runner only

For each kernel launch that ``kdamoe.kernels.moe.experts.MoEExpertsFunction`` makes (forward gate/up, forward down,
backward ∂g' = ∂out[tok] @ W2 stored at the sorted row (``dg``), the element-wise GLU backward after it
(``glu_rows_bwd``), backward ∂x, the two weight gradients) it times every candidate block configuration on the same
inputs (``triton.testing.do_bench``, median) and reports ms, TFLOP/s (GEMMs) or GB/s (``glu_rows_bwd``), registers
and spills per thread, and whether the PTX holds ``wgmma`` (Hopper's warpgroup MMA; without it the GEMM is on a
slower path). The kernels' autotune lists are chosen from it (docs/kernels.md).

Order: every config with BM = 128 first (the weight gradients: BP <= 128), kernel by kernel — dg, dx, dw1, dw2,
glu_rows_bwd, down, gate_up — then the BM = 256 (BP = 256) ones: on the last H200 run the 150 s limit of
``device_e2e.sh`` fell inside BM = 256 configs that failed or spilled, before the weight gradients were reached.
A config whose pipelined A and B tiles, ``(BM·BK + BK·BN)·2 bytes·stages`` (two B tiles for gate_up), exceed the
H200's shared memory per block is recorded as skipped without compiling (it fails with ``OutOfResources``). After
``--budget-s`` seconds from the start no new measurement begins; the rest are recorded as skipped.

Prints each row as one JSON line as it is measured and rewrites ``moe_rows_tune.json`` in ``--out`` ($OUT) after
every row (written to ``.tmp``, then renamed: a kill loses only the measurement in flight);
``moe_rows_tune.md`` at the end.

Routing: each token picks ``top_k`` distinct experts uniformly at random (fixed seed), so experts hold about
``tokens·top_k/experts`` rows each, as a balanced router gives.
"""

import argparse
import json
import os
import sys
import time

T0 = time.monotonic()  # the budget counts from here: the imports and CUDA's start-up are inside device_e2e's limit

# E402 below: after T0, so that the budget counts the slow imports (torch, triton, the kernels)
import torch  # noqa: E402  (after T0)
import triton  # noqa: E402  (after T0)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the harness
from harness import add_moe_shape_args, device_name, time_ms, write_json  # noqa: E402  (it puts the repo on the path)

from kdamoe.kernels.moe import grouped_gemm as gg  # noqa: E402  (needs the repository on sys.path: harness)
from kdamoe.kernels.moe.activation import ACTIVATIONS  # noqa: E402  (the same)
from kdamoe.kernels.moe.experts import GLU_COLS, GLU_ROWS, _Plan  # noqa: E402  (the same)
from kdamoe.kernels.moe.permute import tile_offsets  # noqa: E402  (the same)

# (BN, BK, num_warps, num_stages) for the row GEMMs and gate/up; (BP, BQ, BK, warps, stages) for wgrad;
# (BR, BI, warps) for the element-wise GLU backward (experts.py launches GLU_ROWS x GLU_COLS, 4 warps)
ROW_CFGS = [(128, 64, 8, 4), (128, 32, 4, 4), (64, 64, 4, 4), (64, 64, 8, 4), (128, 64, 8, 3), (256, 64, 8, 3),
            (128, 128, 8, 3)]
WGRAD_CFGS = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 32, 8, 5), (128, 64, 64, 4, 4),
              (64, 128, 64, 4, 4), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (256, 128, 64, 8, 3),
              (256, 128, 64, 8, 4)]
# gate/up: BN is the width of each half (the B tile holds 2·BN weight rows, gate then up)
GATE_UP_CFGS = [(64, 64, 8, 3), (64, 64, 8, 4), (128, 64, 8, 3), (64, 64, 4, 4), (64, 32, 4, 4), (128, 32, 8, 4),
                (64, 128, 8, 3)]
GLU_CFGS = [(GLU_ROWS, GLU_COLS, 4), (16, 128, 4), (8, 256, 4), (32, 128, 8), (16, 64, 2)]  # the first: the shipped one
BMS = (128, 256)
# H200 (sm_90): the most shared memory one block may reserve (227 KB, cudaDevAttrMaxSharedMemoryPerBlockOptin)
SMEM_LIMIT = 232448


def smem_estimate(bm: int, bn: int, bk: int, stages: int, b_tiles: int = 1) -> int:
    """Bytes of shared memory a pipelined GEMM config holds: ``stages`` copies of the bf16 A tile [BM, BK] and of
    ``b_tiles`` B tiles [BK, BN] (gate/up loads the gate and the up tile). Triton's epilogue scratch is not
    counted: a config under the limit may still fail, and is then recorded with its error."""
    return (bm * bk + b_tiles * bk * bn) * 2 * stages


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
        return None  # not timed (strict JSON has no NaN)
    return time_ms(fn, True, warmup=10, rep=40)


def _measure(row: dict, launch, flops: int | None, nbytes: int | None, smoke: bool) -> dict:
    """``row`` with the compiled kernel's resources, its median ms and TFLOP/s (``flops``) or GB/s (``nbytes``);
    a config that does not compile (shared memory) is recorded with its error, not fatal."""
    try:
        row.update(_info(launch()))
        ms = _time(launch, smoke)
        if flops is not None:
            row.update(ms=ms, tflops=flops / ms / 1e9 if ms else None)
        else:
            row.update(ms=ms, gbps=nbytes / ms / 1e6 if ms else None)
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    return row


def _write_json(out_dir: str, shape: dict, rows: list) -> None:
    """``moe_rows_tune.json`` through a ``.tmp`` file and a rename, so a kill mid-write leaves the previous one
    (``device_e2e.sh`` removes the ``.tmp``)."""
    write_json(os.path.join(out_dir, "moe_rows_tune.json"), {"shape": shape, "rows": rows})


def _markdown(shape: dict, rows: list) -> str:
    lines = [f"# Experts kernel sweep: {shape}", "",
             "| kernel | config | ms | TFLOP/s | GB/s | regs | spills | wgmma | note |",
             "|---|---|---|---|---|---|---|---|---|"]

    def num(v, fmt):
        return "" if v is None or v != v else format(v, fmt)

    def cell(v):
        return "" if v is None else v

    for r in sorted(rows, key=lambda r: (r["gemm"], r.get("ms") or 1e9)):
        cfg = " ".join(f"{key}{r[key]}" for key in ("BM", "BN", "BP", "BQ", "BR", "BI", "BK", "warps", "stages")
                       if key in r)
        note = r.get("error") or (f"skipped: {r['skipped']}" if "skipped" in r else "")
        lines.append(f"| {r['gemm']} | {cfg} | {num(r.get('ms'), '.3f')} | {num(r.get('tflops'), '.0f')} | "
                     f"{num(r.get('gbps'), '.0f')} | {cell(r.get('regs'))} | {cell(r.get('spills'))} | "
                     f"{cell(r.get('wgmma'))} | {note} |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_moe_shape_args(p)
    p.add_argument("--budget-s", type=float, default=140.0,
                   help="no measurement starts later than this many seconds after the start (device_e2e.sh kills "
                        "the sweep at 150 s)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes, first configs only (CPU interpreter); fails if a launch raises")
    p.add_argument("--gemms", default=None,
                   help="comma-separated kernels to sweep (of dg, dx, dw1, dw2, glu_rows_bwd, down, gate_up; "
                        "default all)")
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    a = p.parse_args()
    names = ("dg", "dx", "dw1", "dw2", "glu_rows_bwd", "down", "gate_up")
    wanted = set(names if a.gemms is None else a.gemms.split(","))
    if not wanted <= set(names):
        p.error(f"--gemms: unknown kernel(s) {sorted(wanted - set(names))}; choose from {', '.join(names)}")
    if a.smoke:
        a.tokens, a.experts, a.latent, a.inter, a.top_k = 64, 4, 64, 32, 2
    deadline = T0 + a.budget_s
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
    gbuf = torch.randn(m, inter, device=dev).to(dt)  # g of the forward = ∂g' of the backward (same shape)
    h = torch.randn(m, 2 * inter, device=dev).to(dt)
    dout = torch.randn(n, L, device=dev).to(dt)
    dh = torch.randn(m, 2 * inter, device=dev).to(dt)
    y = torch.empty(m, L, device=dev, dtype=dt)
    gout = torch.empty(m, inter, device=dev, dtype=dt)
    hout = torch.empty(m, 2 * inter, device=dev, dtype=dt)
    dw = torch.empty(m, device=dev, dtype=torch.float32)
    act = ACTIVATIONS["situ"]
    rows_fn = gg._rows_gemm_kernel.fn if hasattr(gg._rows_gemm_kernel, "fn") else gg._rows_gemm_kernel
    gu_fn = gg._gate_up_fwd_kernel.fn if hasattr(gg._gate_up_fwd_kernel, "fn") else gg._gate_up_fwd_kernel
    wg_fn = gg._wgrad_kernel.fn if hasattr(gg._wgrad_kernel, "fn") else gg._wgrad_kernel
    es = dt.itemsize
    flops = {"gate_up": 2 * m * L * 2 * inter, "down": 2 * m * inter * L, "dg": 2 * m * L * inter,
             "dx": 2 * m * 2 * inter * L, "dw1": 2 * m * 2 * inter * L, "dw2": 2 * m * L * inter}
    # glu_rows_bwd moves ∂g' [M, I] and h [M, 2I] in, ∂h [M, 2I] out, plus order, w (read) and ∂w (written), 4 B each
    glu_bytes = m * inter * es + 2 * m * 2 * inter * es + 3 * m * 4
    plans = {bm: _plan(idx, e, bm) for bm in BMS}
    experts = torch.arange(e, device=dev, dtype=torch.int32)
    dw1 = torch.empty_like(w1)
    dw2 = torch.empty_like(w2)

    def rows_gemm(name, bm, bn, bk, nw, ns):
        """``(row, launch, flops, bytes, smem)`` of one call of ``_rows_gemm_kernel`` as experts.py makes it."""
        plan = plans[bm]
        common = (plan.order, plan.tile_expert, plan.tile_offs, plan.row_offs)
        # a, b, out, N_OUT, K_DIM, stride_am, stride_be, stride_bk, stride_bn, GATHER_A, SORTED_OUT
        args = {"down": (gbuf, w2, y, L, inter, inter, L * inter, 1, inter, False, False),
                "dg": (dout, w2, gout, inter, L, L, L * inter, inter, 1, True, True),
                "dx": (dh, w1, y, L, 2 * inter, 2 * inter, 2 * inter * L, L, 1, False, False)}[name]
        a_, b_, out, n_out, k_dim, sam, sbe, sbk, sbn, ga, so = args

        def launch():
            return rows_fn[(plan.max_tiles * triton.cdiv(n_out, bn),)](
                a_, b_, *common, out, e, n_out, k_dim, k, sam, sbe, sbk, sbn,
                GATHER_A=ga, SORTED_OUT=so, PREC=prec, BM=bm, BN=bn, BK=bk, num_warps=nw, num_stages=ns)

        row = {"gemm": name, "BM": bm, "BN": bn, "BK": bk, "warps": nw, "stages": ns}
        return row, launch, flops[name], None, smem_estimate(bm, bn, bk, ns)

    def gate_up(bm, bn, bk, nw, ns):
        plan = plans[bm]

        def launch():
            return gu_fn[(plan.max_tiles * triton.cdiv(inter, bn),)](
                x, w1, plan.order, plan.tile_expert, plan.tile_offs, plan.row_offs, w, gout, hout, e, inter, L,
                4.0, 25.0, TOPK=k, ACT=act, SAVE_H=True, PREC=prec, BM=bm, BN=bn, BK=bk, num_warps=nw,
                num_stages=ns)

        row = {"gemm": "gate_up", "BM": bm, "BN": bn, "BK": bk, "warps": nw, "stages": ns}
        return row, launch, flops["gate_up"], None, smem_estimate(bm, bn, bk, ns, b_tiles=2)

    def wgrad(name, bp, bq, bk, nw, ns):
        plan = plans[BMS[0]]  # the weight gradients read only order and row_offs
        # a, b, out, P, Q, stride_am, stride_bm, GATHER_A, GATHER_B
        args = {"dw1": (dh, x, dw1, 2 * inter, L, 2 * inter, L, False, True),
                "dw2": (dout, gbuf, dw2, L, inter, L, inter, True, False)}[name]
        a_, b_, out, p_, q_, sam, sbm, ga, gb = args

        def launch():
            return wg_fn[(e * triton.cdiv(p_, bp) * triton.cdiv(q_, bq),)](
                a_, b_, plan.order, plan.row_offs, experts, out, e, p_, q_, sam, sbm,
                TOPK=k, GATHER_A=ga, GATHER_B=gb, PREC=prec, BP=bp, BQ=bq, BK=bk, num_warps=nw, num_stages=ns)

        row = {"gemm": name, "BP": bp, "BQ": bq, "BK": bk, "warps": nw, "stages": ns}
        return row, launch, flops[name], None, smem_estimate(bp, bq, bk, ns)

    def glu_rows_bwd(br, bi, nw):
        plan = plans[BMS[0]]

        def launch():
            return gg._glu_rows_bwd_kernel[(triton.cdiv(m, br),)](
                gbuf, h, plan.order, plan.row_offs, w, hout, dw, m, e, inter, 4.0, 25.0,
                ACT=act, BR=br, BI=bi, num_warps=nw)

        return {"gemm": "glu_rows_bwd", "BR": br, "BI": bi, "warps": nw}, launch, None, glu_bytes, 0

    row_cfgs = ROW_CFGS[:1] if a.smoke else ROW_CFGS
    gate_up_cfgs = GATE_UP_CFGS[:1] if a.smoke else GATE_UP_CFGS
    wgrad_cfgs = WGRAD_CFGS[:1] if a.smoke else WGRAD_CFGS
    glu_cfgs = GLU_CFGS[:1] if a.smoke else GLU_CFGS
    jobs = []
    for bm in (BMS[:1] if a.smoke else BMS):
        rcfgs = [c for c in row_cfgs if bm * c[0] <= 128 * 256]  # BM 256 x BN 256: the accumulator alone spills
        jobs += [rows_gemm(name, bm, *c) for name in ("dg", "dx") for c in rcfgs]
        jobs += [wgrad(name, *c) for name in ("dw1", "dw2") for c in wgrad_cfgs if (c[0] <= 128) == (bm == 128)]
        if bm == BMS[0]:
            jobs += [glu_rows_bwd(*c) for c in glu_cfgs]
        jobs += [rows_gemm("down", bm, *c) for c in rcfgs]
        jobs += [gate_up(bm, *c) for c in gate_up_cfgs if bm * c[0] <= 128 * 128]
    jobs = [j for j in jobs if j[0]["gemm"] in wanted]

    os.makedirs(a.out, exist_ok=True)
    shape = {"tokens": n, "experts": e, "latent": L, "inter": inter, "top_k": k, "dtype": str(dt),
             "torch": torch.__version__, "triton": triton.__version__, "budget_s": a.budget_s,
             "smem_limit": SMEM_LIMIT, "gpu": device_name(dev.type == "cuda")}
    rows = []
    for row, launch, fl, nbytes, smem in jobs:
        if time.monotonic() >= deadline:
            row["skipped"] = "budget"
        elif smem > SMEM_LIMIT:
            row.update(skipped="smem", smem_est=smem)
        else:
            _measure(row, launch, fl, nbytes, a.smoke)
        rows.append(row)
        print(json.dumps(row), flush=True)
        _write_json(a.out, shape, rows)
    _write_json(a.out, shape, rows)  # also with no job at all
    md = _markdown(shape, rows)
    with open(os.path.join(a.out, "moe_rows_tune.md"), "w") as f:
        f.write(md)
    print(md)
    if a.smoke and any("error" in r for r in rows):
        raise SystemExit("smoke: a launch failed (see its row)")  # on the GPU a failed config is a result


if __name__ == "__main__":
    main()
