"""KDA kernels on one GPU: bf16 correctness against a float32 reference, then timings side by side with fla.

One device call does everything:

1. correctness (B=1, H=2, K=V=128, T ∈ {4K, 32K, 128K}): ours and fla in bf16, both with the gate and the
   L2 norm inside the kernel, against an independent float32 PyTorch reference (16-token chunks, direct
   exp(G_i − G_j), triangular solves, Python loop over chunks; tf32 off). Relative L2 error of the output
   and of every gradient (q, k, v, raw gate f, beta, dt_bias).
2. timings with fla called as the team's peer benchmark calls it: B=1, H=16, K=V=128, bf16,
   ``use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=None, dt_bias=0, safe_gate=True,
   lower_bound=-5``; forward and forward+backward at T ∈ {8K, 32K, 128K}; one fused_recurrent decode step
   at B ∈ {1, 64} (precomputed gate, L2 norm in kernel, fp32 initial state, final state out).
3. (``--stages``) the time of each of our stages at T=32K, to say where time goes.

Writes ``kda_h200.json`` (rows ``{name, ours_ms, peer, peer_ms, ratio}``), ``kda_h200_errors.json`` and
``kda_h200.md`` into ``--out`` (default ``$OUT`` or ``benchmarks/results``).

FLOP and byte counts (nominal, the same for both implementations; chunk C=64, D = K = V):
forward ``6·K·V + 3·C·K + 2·C·V`` FLOP per token-head (state products 6KV, intra-chunk C²-terms), backward
twice that; fewest bytes: forward reads q, k, v, f (bf16), beta and writes o: ``10·D + 2`` bytes per
token-head; forward+backward adds reading them and dO again and writing five gradients: ``28·D + 6``.
Ceilings (measured on the H200, docs/architecture.md §9): 757 TFLOP/s bf16 GEMM, 4.27 TB/s device copy.
"""

import argparse
import json
import os
import sys
import time
import traceback

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import device_name, kernels_only, time_ms, write_json, write_text  # noqa: E402  (benchmarks/ on the path)

# the kernels need torch and triton only, not kdamoe/__init__'s transformers (a GPU image's may be older)
kernels_only()

from tuning.kda_intra_phases import phase_times  # noqa: E402  (imports kdamoe.kernels: after kernels_only())

from kdamoe.kernels import chunk_kda, fused_recurrent_kda  # noqa: E402  (after kernels_only())
from kdamoe.kernels.kda import backward, intra, output, prepare, state  # noqa: E402  (after kernels_only())

PEAK_TFLOPS = 757.0
PEAK_TBPS = 4.27
LB = -5.0


def bench(fn, rep=200):
    return time_ms(fn, True, warmup=50, rep=rep)


# ----------------------------------------------------------------------------------------------------------
# float32 reference (independent of both kernels)
# ----------------------------------------------------------------------------------------------------------
def reference_kda(q, k, v, f, beta, dt_bias, C=16):
    """float32 chunked KDA with the in-kernel gate and L2 norm applied in PyTorch. Inputs [1, T, H, ·]."""
    _, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    g = LB * torch.sigmoid(f + dt_bias.view(H, K))
    NT = T // C

    def r(x):
        return x[0].reshape(NT, C, H, -1).permute(2, 0, 1, 3)  # [H, NT, C, D]

    q, k, v, g = r(q), r(k), r(v), r(g)
    b = beta[0].reshape(NT, C, H).permute(2, 0, 1)
    G = g.cumsum(2)
    idx = torch.arange(C, device=q.device)
    causal = idx[:, None] >= idx[None, :]
    D = torch.exp((G[:, :, :, None, :] - G[:, :, None, :, :]).masked_fill(~causal[..., None], float("-inf")))
    Akk = torch.einsum("hnid,hnjd,hnijd->hnij", k, k, D) * b[..., None]
    Akk = Akk.masked_fill(~(idx[:, None] > idx[None, :]), 0.)
    Aqk = torch.einsum("hnid,hnjd,hnijd->hnij", q, k, D) * scale
    L = torch.eye(C, device=q.device, dtype=q.dtype) + Akk
    Gam = G.exp()
    u = torch.linalg.solve_triangular(L, b[..., None] * v, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(L, b[..., None] * k * Gam, upper=False, unitriangular=True)
    qg = q * Gam * scale
    kg = k * torch.exp(G[:, :, -1:, :] - G)
    glast = Gam[:, :, -1, :]
    S = torch.zeros(H, K, V, device=q.device, dtype=q.dtype)
    outs = []
    for n in range(NT):
        d = u[:, n] - w[:, n] @ S
        outs.append(qg[:, n] @ S + Aqk[:, n] @ d)
        S = glast[:, n, :, None] * S + kg[:, n].transpose(-1, -2) @ d
    return torch.stack(outs, 1).permute(1, 2, 0, 3).reshape(1, T, H, V)


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def correctness(T, H, D, ours, fla, dev):
    torch.manual_seed(T)

    def mk(*s):
        return torch.randn(*s, device=dev, dtype=torch.bfloat16)

    q, k, v, f = mk(1, T, H, D), mk(1, T, H, D), mk(1, T, H, D), mk(1, T, H, D)
    beta = torch.rand(1, T, H, device=dev, dtype=torch.bfloat16)
    dt_bias = torch.randn(H * D, device=dev) * 0.5
    do = mk(1, T, H, D)
    names = ["q", "k", "v", "f", "beta", "dt_bias"]

    def run(fn):
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, f, beta, dt_bias)]
        o = fn(*leaves[:5], use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=None, dt_bias=leaves[5],
               safe_gate=True, lower_bound=LB)[0]
        o.backward(do)
        return [o.detach()] + [x.grad for x in leaves]

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    leaves = [x.detach().float().requires_grad_(True) for x in (q, k, v, f, beta, dt_bias)]
    ro = reference_kda(*leaves)
    ro.backward(do.float())
    ref = [ro.detach()] + [x.grad for x in leaves]
    del ro, leaves
    torch.cuda.empty_cache()
    res = {"T": T, "H": H, "D": D}
    for tag, fn in (("ours", ours), ("fla", fla)):
        if fn is None:
            continue
        try:
            got = run(fn)
            errs = {n: rel(a, b) for n, a, b in zip(["o"] + ["d" + n for n in names], got, ref, strict=True)}
            errs["max"] = max(errs.values())
            res[tag] = errs
        except Exception as e:  # keep going: the report says what failed
            traceback.print_exc()
            res[tag] = {"error": repr(e)[:300]}
        torch.cuda.empty_cache()
    return res


# ----------------------------------------------------------------------------------------------------------
def flops_fwd(T, H, K, V, C=64):
    return T * H * (6 * K * V + 3 * C * K + 2 * C * V)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--lengths", default="8192,32768,131072")
    ap.add_argument("--check-lengths", default="4096,32768,131072")
    ap.add_argument("--stages", action="store_true")
    ap.add_argument("--intra-phases", action="store_true", help="time each phase of the intra kernel at 128K")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--check-fla", action="store_true", help="also measure fla's error against the reference")
    ap.add_argument("--stage-budget-s", type=float, default=420.0, help="skip --stages if more time has passed")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = "cuda"
    print("torch", torch.__version__, "triton", triton.__version__, device_name(True), flush=True)
    fla_chunk = fla_rec = None
    fla_ver = "fla"
    if not args.no_fla:
        try:
            import fla  # noqa: PLC0415  (the peer is optional: --no-fla, or an image without fla, times ours alone)
            from fla.ops.kda import chunk_kda as fla_chunk  # noqa: PLC0415  (the same)
            from fla.ops.kda import fused_recurrent_kda as fla_rec  # noqa: PLC0415  (the same)
            fla_ver = "fla " + getattr(fla, "__version__", "?")
        except Exception:
            traceback.print_exc()
    rows, errors = [], []

    t_start = time.time()
    check_lengths = [] if args.skip_check else [int(x) for x in args.check_lengths.split(",") if x]

    def check(T):
        t = time.time()
        r = correctness(T, 2, 128, chunk_kda, fla_chunk if args.check_fla else None, dev)
        errors.append(r)
        print("check T", T, json.dumps({k: v for k, v in r.items() if k in ("ours", "fla")}), f"{time.time()-t:.1f}s",
              flush=True)
        torch.backends.cuda.matmul.allow_tf32 = False

    # ---- 1. correctness at the first length (the rest after the timings, so a late stop keeps the timings) ----
    if check_lengths:
        check(check_lengths[0])

    # ---- 2. timings ----
    H, D = 16, 128
    for T in [int(x) for x in args.lengths.split(",") if x]:
        rows += chunk_rows(T, H, D, dev, fla_chunk, fla_ver)
        torch.cuda.empty_cache()  # the inputs of this length are freed: chunk_rows returned
    for Bd in (1, 64):
        rows.append(decode_row(Bd, H, D, dev, fla_rec, fla_ver))

    write(args.out, rows, errors, {}, fla_ver)
    for T in check_lengths[1:]:
        check(T)
        write(args.out, rows, errors, {}, fla_ver)

    # ---- 3. stage breakdown ----
    stages = {}
    if args.stages and time.time() - t_start < args.stage_budget_s:
        stages = stage_times(32768, H, D, dev)
        print("stages (ms):", json.dumps(stages), flush=True)

    if args.intra_phases and time.time() - t_start < args.stage_budget_s:
        try:
            stages["intra_phases_T128K"] = intra_phase_times(131072, H, D, dev)
            print("intra phases (ms):", json.dumps(stages["intra_phases_T128K"]), flush=True)
        except Exception:
            traceback.print_exc()
    write(args.out, rows, errors, stages, fla_ver)


def chunk_rows(T, H, D, dev, fla_chunk, fla_ver):
    """The ``chunk_kda_fwd`` and ``chunk_kda_fwdbwd`` rows at ``T`` tokens: ours and ``fla_chunk`` (None: ours
    alone) on the same bf16 inputs ``[1, T, H, D]``, the gate and L2 norm in the kernel."""
    torch.manual_seed(0)

    def mk():
        return torch.randn(1, T, H, D, device=dev, dtype=torch.bfloat16, requires_grad=True)

    q, k, v, graw = mk(), mk(), mk(), mk()
    beta = torch.rand(1, T, H, device=dev, dtype=torch.bfloat16).requires_grad_(True)
    dt_bias = torch.zeros(H * D, device=dev, dtype=torch.float32)
    do = torch.randn_like(v)
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=None, dt_bias=dt_bias, safe_gate=True,
              lower_bound=LB)
    res = {}
    for tag, fn in (("ours", chunk_kda), ("peer", fla_chunk)):
        if fn is None:
            continue
        try:
            def fwd(fn=fn):
                return fn(q, k, v, graw, beta, **kw)[0]

            def fwd_bwd(fwd=fwd):
                fwd().backward(do)

            res[tag + "_fwd"] = bench(fwd)
            res[tag + "_fwdbwd"] = bench(fwd_bwd, rep=100)
        except Exception:
            traceback.print_exc()
        torch.cuda.empty_cache()
    if fla_chunk is not None:
        with torch.no_grad():
            diff = rel(chunk_kda(q, k, v, graw, beta, **kw)[0], fla_chunk(q, k, v, graw, beta, **kw)[0])
        print(f"T={T}: ours vs fla output rel diff {diff:.2e}", flush=True)
    rows = []
    for mode in ("fwd", "fwdbwd"):
        o_ms, p_ms = res.get("ours_" + mode), res.get("peer_" + mode)
        fl = flops_fwd(T, H, D, D) * (3 if mode == "fwdbwd" else 1)
        by = T * H * ((10 * D + 2) if mode == "fwd" else (28 * D + 6))
        rows.append({"name": f"chunk_kda_{mode}_T{T // 1024}K", "ours_ms": o_ms, "peer": fla_ver, "peer_ms": p_ms,
                     "ratio": (o_ms / p_ms) if (o_ms and p_ms) else None,
                     "flop": fl, "bytes": by})
        print(rows[-1], flush=True)
    return rows


def decode_row(Bd, H, D, dev, fla_rec, fla_ver):
    """The ``fused_recurrent_decode_B{Bd}`` row: one decode step of ours and ``fla_rec`` (None: ours alone) for
    ``Bd`` sequences, precomputed gate, L2 norm in the kernel, float32 initial state, final state out."""
    q = torch.randn(Bd, 1, H, D, device=dev, dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    g = -torch.rand_like(q).float()
    beta = torch.rand(Bd, 1, H, device=dev, dtype=torch.bfloat16)
    h0 = torch.randn(Bd, H, D, D, device=dev, dtype=torch.float32)
    res = {}
    for tag, fn in (("ours", fused_recurrent_kda), ("peer", fla_rec)):
        if fn is None:
            continue
        try:
            res[tag] = bench(lambda fn=fn: fn(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                              use_qk_l2norm_in_kernel=True))
        except Exception:
            traceback.print_exc()
    if fla_rec is not None:
        a = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                use_qk_l2norm_in_kernel=True)
        b = fla_rec(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        print(f"decode B={Bd}: ours vs fla rel diff o {rel(a[0], b[0]):.2e} state {rel(a[1], b[1]):.2e}")
    o_ms, p_ms = res.get("ours"), res.get("peer")
    row = {"name": f"fused_recurrent_decode_B{Bd}", "ours_ms": o_ms, "peer": fla_ver, "peer_ms": p_ms,
           "ratio": (o_ms / p_ms) if (o_ms and p_ms) else None,
           "flop": 6 * Bd * H * D * D, "bytes": 2 * Bd * H * D * D * 4}
    print(row, flush=True)
    return row


def stage_times(T, H, D, dev):
    torch.manual_seed(0)

    def mk():
        return torch.randn(1, T, H, D, device=dev, dtype=torch.bfloat16)

    q, k, v, f, do = mk(), mk(), mk(), mk(), mk()
    beta = torch.rand(1, T, H, device=dev, dtype=torch.bfloat16)
    dtb = torch.zeros(H * D, device=dev)
    cu = torch.tensor([0, T], dtype=torch.int32, device=dev)
    ci, co, NC = prepare.chunk_table(cu, T, T)
    sc = D ** -0.5
    out = {}
    out["prepare_alone"] = bench(lambda: prepare.prepare_fwd(q, k, f, None, dtb, LB, ci, cu, NC, True, True))
    out["prepare+intra"] = bench(lambda: intra.intra_fwd(q, k, f, v, beta, None, dtb, LB, sc, True, True, ci, cu, NC))
    qn, kn, rq, rk, G, Aqk, M, w, u, kg, qg = intra.intra_fwd(q, k, f, v, beta, None, dtb, LB, sc, True, True, ci, cu,
                                                              NC)
    out["state_fwd"] = bench(lambda: state.state_fwd(w, u, kg, G, None, cu, co, NC, 1, False))
    h, vnew, _ = state.state_fwd(w, u, kg, G, None, cu, co, NC, 1, False)
    out["output"] = bench(lambda: output.output_fwd(qg, h, vnew, Aqk, ci, cu, NC))
    out["dv_local"] = bench(lambda: output.dv_local(Aqk, do, ci, cu, NC))
    dvl = output.dv_local(Aqk, do, ci, cu, NC)
    out["state_bwd"] = bench(lambda: state.state_bwd(qg, G, w, kg, do, dvl, None, cu, co, NC, 1, False))
    dh, dvnew, _ = state.state_bwd(qg, G, w, kg, do, dvl, None, cu, co, NC, 1, False)
    out["bwd_wy"] = bench(lambda: backward.bwd_wy(qn, kn, v, G, beta, M, h, dh, vnew, dvnew, do, sc, ci, cu, NC))
    r = backward.bwd_wy(qn, kn, v, G, beta, M, h, dh, vnew, dvnew, do, sc, ci, cu, NC)
    out["bwd_intra"] = bench(lambda: backward.bwd_intra(qn, kn, G, beta, *r[:7], rq, rk, f, None, dtb, sc, LB, ci, cu,
                                                        NC, q.dtype, k.dtype, f.dtype, True, True))
    return {k_: round(v_, 4) for k_, v_ in out.items()}


def intra_phase_times(T, H, D, dev):
    """Time each phase of our intra kernel alone (benchmarks/tuning/kda_intra_phases.py), 4 and 8 warps."""
    return phase_times(T, H, D, dev, bench, LB)


def write(out_dir, rows, errors, stages, fla_ver):
    write_json(os.path.join(out_dir, "kda_h200.json"),
               [{k: r[k] for k in ("name", "ours_ms", "peer", "peer_ms", "ratio")} for r in rows])
    write_json(os.path.join(out_dir, "kda_h200_errors.json"), {"errors": errors, "stages_ms_T32K": stages})
    lines = ["# KDA kernels on one H200 (bf16, B=1, H=16, K=V=128; gate and L2 norm in kernel)", "",
             f"Peer: {fla_ver}, called with the arguments above, in the same process.",
             "Times: triton.testing.do_bench medians (ms). TFLOP/s and GB/s from the nominal counts in",
             f"benchmarks/bench_kda.py, against the ceilings {PEAK_TFLOPS:.0f} TFLOP/s and {PEAK_TBPS} TB/s.", "",
             "| case | ours ms | fla ms | ours/fla | ours TFLOP/s (% peak) | ours GB/s (% copy) |",
             "|---|---|---|---|---|---|"]

    def fmt(x):
        return f"{x:.4f}" if x else "-"

    for r in rows:
        o, p = r["ours_ms"], r["peer_ms"]
        if o:
            tf = r["flop"] / o / 1e9
            gb = r["bytes"] / o / 1e6
            perf = f"{tf:.1f} ({100 * tf / PEAK_TFLOPS:.1f}%)", f"{gb:.0f} ({100 * gb / (PEAK_TBPS * 1e3):.1f}%)"
        else:
            perf = ("-", "-")
        lines.append(f"| {r['name']} | {fmt(o)} | {fmt(p)} | {fmt(r['ratio'])} | {perf[0]} | {perf[1]} |")
    if errors:
        lines += ["", "## bf16 error against a float32 reference (relative L2; B=1, H=2, K=V=128)", "",
                  "| T | impl | o | dq | dk | dv | df | dbeta | ddt_bias |", "|---|---|---|---|---|---|---|---|---|"]
        for e in errors:
            for tag in ("ours", "fla"):
                x = e.get(tag)
                if not x:
                    continue
                if "error" in x:
                    lines.append(f"| {e['T']} | {tag} | error: {x['error'][:80]} |")
                    continue
                cols = ["o", "dq", "dk", "dv", "df", "dbeta", "ddt_bias"]
                lines.append(f"| {e['T']} | {tag} | " + " | ".join(f"{x[c]:.2e}" for c in cols) + " |")
    flat = {k: v for k, v in stages.items() if not isinstance(v, dict)}
    if flat:
        lines += ["", "## our stages at T=32K (ms, each timed alone)", "",
                  "| " + " | ".join(flat) + " |", "|" + "---|" * len(flat),
                  "| " + " | ".join(f"{v:.3f}" for v in flat.values()) + " |"]
    for name, sub in stages.items():
        if isinstance(sub, dict):
            lines += ["", f"## {name} (ms, each phase timed alone)", "",
                      "| " + " | ".join(sub) + " |", "|" + "---|" * len(sub),
                      "| " + " | ".join(f"{v:.3f}" for v in sub.values()) + " |"]
    write_text(os.path.join(out_dir, "kda_h200.md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
