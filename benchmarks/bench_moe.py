"""MoE on one GPU: the router (Triton route kernel vs the model's PyTorch router op) and the routed experts.

    python benchmarks/bench_moe.py --router-only      # router case only (about a minute on an H200)
    python benchmarks/bench_moe.py --router-linear    # the router linear: float32 vs TF32 / bf16 GEMMs
    python benchmarks/bench_moe.py [--quick] [--profile]
    TRITON_INTERPRET=1 python benchmarks/bench_moe.py --smoke [--router-only]   # CPU check of the runner

Writes ``moe_router.{json,md}`` and (unless ``--router-only``) ``moe_experts.{json,md}`` into ``$OUT``
(``--router-linear``: ``router_linear.{json,md}`` only)
(default ``./bench_out``) and prints the tables. Every file names the stack it measured: torch, triton, GPU,
CUDA, the commit (``$KDAMOE_COMMIT``, else ``git rev-parse HEAD``) and a hash of the measured sources.

router: what ``KDAMoETopkRouter.forward`` runs, both paths from ``kdamoe.model.kernel_dispatch.moe_route_op``:
  the router linear in float32 on bf16 activations, then the route op (``moe_torch.moe_route_torch``:
  sigmoid + topk + gather + normalise + selection margins + histogram + bincount; or the kernel
  ``kernels.moe_route``: one pass), then the float64 accumulation. Modes: ``train_fwd`` (statistics on),
  ``train_fwdbwd`` (plus the backward through the gate weights to the router weight and the activations)
  and ``eval_fwd`` (no statistics, no grad).
router linear (``--router-linear``, issue #40 Deliver 2): the router's ``x Wᵀ`` and its ∂x and ∂W at our 1.68 B shape
  and K3's (T = 32K; d = 1,024, E = 64 and d = 7,168, E = 896): float32 as today, TF32, bf16 GEMMs with float32
  logits (``RouterLinearBF16``), and a plain bf16 ``F.linear``. Which of them keep the top-k sets is measured on
  the CPU by ``router_precision.py``; this times them.
experts: ours = ``moe_route`` + ``moe_experts``; peer = ``moe_peers.grouped_mm_moe`` (two
  ``torch._grouped_mm``); loop = the model's PyTorch path (``moe_route_torch`` + ``moe_experts_torch``).
  Errors: bf16 against the PyTorch path in float32. FLOPs 6·N·k·ℓ·I forward, 18·N·k·ℓ·I forward+backward.
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# the benchmarks folder is not a package (its path is added above); harness puts the repository on sys.path
from harness import commit, device_name, sources_digest, time_ms, write_results  # noqa: E402  (sys.path above)
from moe_peers import grouped_mm_moe  # noqa: E402  (the same)

from kdamoe.kernels import moe_experts, moe_route  # noqa: E402  (needs the repository on sys.path: harness)
from kdamoe.kernels.utils import relative_error  # noqa: E402  (the same)
from kdamoe.model.kernel_dispatch import moe_route_op  # noqa: E402  (the same)
from kdamoe.model.moe_torch import GLUActivation, moe_experts_torch, moe_route_torch  # noqa: E402  (the same)

CEIL_TFLOPS = 757.0  # bf16 GEMM 8192³ measured on an H200 with this image (docs/kernels.md)
QB_BINS = 1024


# ----------------------------------------------------------------------------------------------------------
# timing and the stack
# ----------------------------------------------------------------------------------------------------------
def bench(fn, dev, grads=None, rep=100):
    """Median ms: ``triton.testing.do_bench`` on CUDA; a few wall-clock runs on the CPU (smoke only)."""
    return time_ms(fn, dev.type == "cuda", warmup=max(25, rep // 4), rep=rep, grads=grads)


def stack(dev):
    """torch / triton / device / commit of this run, for the results files."""
    return {
        "torch": torch.__version__, "triton": triton.__version__,
        "device": device_name(dev.type == "cuda", cpu="cpu (TRITON_INTERPRET=1)"),
        "cuda": torch.version.cuda, "commit": commit() or "unknown",
        "sources_sha256": sources_digest(("kdamoe/kernels/moe", "kdamoe")),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def stack_lines(info):
    return [f"Stack: torch {info['torch']}, triton {info['triton']}, {info['device']} (CUDA {info['cuda']}); "
            f"commit {info['commit']}, sources {info['sources_sha256']}; {info['date']}.", ""]


def write(out, name, payload, lines):
    write_results(out, name, payload, "\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


# ----------------------------------------------------------------------------------------------------------
# router
# ----------------------------------------------------------------------------------------------------------
class RouterStep:
    """``KDAMoETopkRouter.forward`` for one backend, on given weights (bf16 model, float32 router linear)."""

    def __init__(self, backend, weight, bias, top_k, dev):
        self.route = moe_route_op(backend, dev)
        self.weight, self.bias, self.top_k = weight, bias, top_k
        e = weight.shape[0]
        self.load = torch.zeros(e, dtype=torch.float64, device=dev)
        self.qb = torch.zeros(e, QB_BINS, dtype=torch.float64, device=dev)

    def __call__(self, x, record):
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.float(), self.weight.float())
        index, weights, load, qb = self.route(logits, self.bias, self.top_k, 1.0, token_mask=None,
                                              count_tokens=record, num_bins=QB_BINS if record else None)
        if record:
            with torch.no_grad():
                self.load += load
                self.qb += qb
        return index, weights, load, qb


def router_case(n, d, e, k, dev, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(n, d, device=dev, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(e, d, device=dev, generator=g) * d ** -0.5).bfloat16().requires_grad_()
    bias = (torch.randn(e, device=dev, generator=g) * 0.05).float()
    return x, w, bias


def router_bench(cases, dev, rep):
    rows = []
    for n, d, e, k in cases:
        rows += router_rows(n, d, e, k, dev, rep)
        if dev.type == "cuda":
            torch.cuda.empty_cache()  # the case's tensors are freed: router_rows returned
    return rows


def router_rows(n, d, e, k, dev, rep):
    """One router case (``n`` tokens of width ``d``, ``e`` experts, top ``k``): the rows of its three modes, the
    first carrying the two paths' agreement."""
    x, w, bias = router_case(n, d, e, k, dev)
    steps = {b: RouterStep(b, w, bias, k, dev) for b in ("torch", "triton")}
    # agreement of the two paths on the same input (train mode, statistics on)
    it, wt, lt, qt = steps["torch"](x, True)
    ik, wk, lk, qk = steps["triton"](x, True)
    agree = {"index_mismatch_frac": (it != ik).float().mean().item(),
             "weights_max_abs_diff": (wt - wk).abs().max().item(),
             "token_counts_l1_diff": (lt - lk).abs().sum().item(),
             "histogram_l1_diff_frac": ((qt - qk).abs().sum() / qt.sum()).item()}
    dw = torch.randn(n, k, device=dev)
    times = {}
    for b, step in steps.items():
        times[b, "train_fwd"] = bench(lambda step=step: step(x, True), dev, rep=rep)
        times[b, "train_fwdbwd"] = bench(lambda step=step: (step(x, True)[1] * dw).sum().backward(), dev, [x, w], rep)
        with torch.no_grad():
            times[b, "eval_fwd"] = bench(lambda step=step: step(x, False), dev, rep=rep)
    rows = []
    for mode in ("train_fwd", "train_fwdbwd", "eval_fwd"):
        t, tk = times["torch", mode], times["triton", mode]
        rows.append({"case": f"N{n}_d{d}_E{e}_k{k}", "mode": mode, "torch_ms": round(t, 4),
                     "triton_ms": round(tk, 4), "torch_over_triton": round(t / tk, 3)})
        print(json.dumps(rows[-1]), flush=True)
    rows[0]["agreement"] = agree
    print("agreement", json.dumps(agree), flush=True)
    return rows


def router_report(rows, info, out):
    lines = ["# MoE router: model's PyTorch router op vs the Triton route kernel", ""] + stack_lines(info) + [
        "Both include the float32 router linear on bf16 activations and the float64 statistics accumulation, "
        "as `KDAMoETopkRouter.forward` runs them (benchmarks/bench_moe.py, `router`). Median ms; "
        "torch/triton above 1 = the kernel is faster.", "",
        "| case | mode | torch ms | triton ms | torch/triton |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['mode']} | {r['torch_ms']:.4f} | {r['triton_ms']:.4f} | "
                     f"{r['torch_over_triton']:.2f} |")
    lines += ["", "Agreement of the two paths (train mode, same input; sigmoid may differ by an ulp, so near-ties "
              "and values on a bin edge can move):", ""]
    for r in rows:
        if "agreement" in r:
            lines.append(f"- {r['case']}: " + ", ".join(f"{a} {b:.3g}" for a, b in r["agreement"].items()))
    write(out, "moe_router", {"stack": info, "rows": rows}, lines)


# ----------------------------------------------------------------------------------------------------------
# router linear: float32 (today) against cheaper GEMMs (issue #40, Deliver 2; precision: router_precision.py)
# ----------------------------------------------------------------------------------------------------------
# (name, tokens, hidden d, experts E): our 1.68 B shape and K3's (floors.py: hidden 7,168 assumed, the router
# scores all 896 experts on every rank)
ROUTER_LINEAR_SHAPES = [("ours", 32768, 1024, 64), ("K3", 32768, 7168, 896)]


def _mm_fp32_out(a, b, acc=None):
    """``a @ b`` (plus ``acc``) of two bf16 matrices with a float32 result: tensor-core GEMMs writing float32
    (``torch.mm`` / ``torch.addmm`` with ``out_dtype=torch.float32``, CUDA only; a float32 add after the GEMM where
    this torch's ``addmm`` refuses it); elsewhere (CPU smoke runs) the same products in float32 from the bf16
    values."""
    if not a.is_cuda:
        out = a.float() @ b.float()
        return out if acc is None else acc + out
    if acc is None:
        return torch.mm(a, b, out_dtype=torch.float32)
    try:
        return torch.addmm(acc, a, b, out_dtype=torch.float32)
    except (RuntimeError, TypeError):
        return acc + torch.mm(a, b, out_dtype=torch.float32)


class RouterLinearBF16(torch.autograd.Function):
    """Router logits ``x Wᵀ`` on bf16 operands with float32 logits; the backward on bf16 operands too.

    Forward: ``[T, d] bf16 x`` and ``[E, d] W`` (the float32 master or bf16, cast to bf16) → ``[T, E]`` float32.
    Backward, with the float32 ``∂logits`` rounded to bf16 (what a tensor-core GEMM reads): ``∂x = ∂logits · W``
    (bf16, x's dtype) and ``∂W = ∂logitsᵀ · x`` (float32 output, cast to W's dtype)."""

    @staticmethod
    def forward(ctx, x, weight):
        w = weight.bfloat16()
        ctx.save_for_backward(x, w)
        ctx.weight_dtype = weight.dtype
        return _mm_fp32_out(x.bfloat16(), w.t())

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        g = grad.bfloat16()
        dx = (g @ w).to(x.dtype)
        dw = _mm_fp32_out(g.t().contiguous(), x.bfloat16()).to(ctx.weight_dtype)
        return dx, dw


def split_bf16(t):
    """``t ≈ hi + lo`` with ``hi = bf16(t)`` and ``lo = bf16(t − hi)``: about 16 significant bits in two bf16
    tensors (the split of the 3-pass bf16 GEMM trick; the dropped ``lo·lo`` product is ~2^-16 relative)."""
    hi = t.bfloat16()
    return hi, (t.float() - hi.float()).bfloat16()


class RouterLinearBF16x3(RouterLinearBF16):
    """:class:`RouterLinearBF16` with a more precise forward: ``x_hi W_hiᵀ + x_hi W_loᵀ + x_lo W_hiᵀ`` (the hi/lo
    bf16 splits of :func:`split_bf16`), three bf16 GEMMs summed into the float32 logits; two when ``x`` is already
    bf16 (``x_lo = 0``). The backward is the bf16 one (the gradients need no more than bf16; the top-k sets need the
    precise logits)."""

    @staticmethod
    def forward(ctx, x, weight):
        w_hi, w_lo = split_bf16(weight)
        ctx.save_for_backward(x, w_hi)
        ctx.weight_dtype = weight.dtype
        if x.dtype == torch.bfloat16:
            return _mm_fp32_out(x, w_lo.t(), _mm_fp32_out(x, w_hi.t()))
        x_hi, x_lo = split_bf16(x)
        out = _mm_fp32_out(x_hi, w_hi.t())
        return _mm_fp32_out(x_lo, w_hi.t(), _mm_fp32_out(x_hi, w_lo.t(), out))


def router_linear_variants():
    """name -> (what it is, ``fn(x bf16 [T, d], W float32 [E, d]) -> float32 logits [T, E]``, TF32 on)."""
    return {
        "float32": ("x.float() · W.float(), float32 GEMMs (today's router)",
                    lambda x, w: F.linear(x.float(), w.float()), False),
        "tf32": ("the same float32 tensors with TF32 tensor cores allowed",
                 lambda x, w: F.linear(x.float(), w.float()), True),
        "bf16_fp32_out": ("bf16 GEMMs with float32 logits and ∂W (RouterLinearBF16)", RouterLinearBF16.apply, False),
        "bf16x3_fwd": ("forward from the hi/lo bf16 splits (RouterLinearBF16x3: 2 GEMMs on bf16 x, 3 on float32 x), "
                       "float32 logits; backward as bf16_fp32_out", RouterLinearBF16x3.apply, False),
        "bf16_out": ("F.linear on bf16, logits rounded to bf16, then float32",
                     lambda x, w: F.linear(x, w.bfloat16()).float(), False),
    }


def router_linear_rows(shapes, dev, rep):
    """Forward and forward + ∂x + ∂W of every variant at every shape (median ms), with each variant's relative
    errors of the logits, ∂x and ∂W against float64 products of the same bf16 x and float32 W."""
    rows = []
    for name, n, d, e in shapes:
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(n, d, device=dev, generator=g).bfloat16().requires_grad_()
        w = (torch.randn(e, d, device=dev, generator=g) * d ** -0.5).requires_grad_()
        dy = torch.randn(n, e, device=dev, generator=g)
        with torch.no_grad():
            x64, w64, dy64 = x.double(), w.double(), dy.double()
            ref = (x64 @ w64.T, dy64 @ w64, dy64.T @ x64)
        flop = 2 * n * d * e
        for vname, (_, fn, tf32) in router_linear_variants().items():
            old = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = tf32
            try:
                x.grad = w.grad = None  # the previous variant's timed backward left its gradients
                out = fn(x, w)
                out.backward(dy)
                errs = [relative_error(a.double(), r) for a, r in zip((out.detach(), x.grad, w.grad), ref,
                                                                       strict=True)]
                x.grad = w.grad = None
                with torch.no_grad():
                    fwd = bench(lambda fn=fn, x=x, w=w: fn(x, w), dev, rep=rep)
                fwdbwd = bench(lambda fn=fn, x=x, w=w, dy=dy: fn(x, w).backward(dy), dev, [x, w], rep)
            finally:
                torch.backends.cuda.matmul.allow_tf32 = old
            rows.append({"shape": name, "tokens": n, "d": d, "experts": e, "variant": vname,
                         "fwd_ms": round(fwd, 4), "fwdbwd_ms": round(fwdbwd, 4),
                         "fwdbwd_tflops": round(3 * flop / fwdbwd / 1e9, 1),
                         "rel_err_logits": errs[0], "rel_err_dx": errs[1], "rel_err_dw": errs[2]})
            print(json.dumps(rows[-1]), flush=True)
        del x, w, dy, ref, x64, w64, dy64
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    base = {(r["shape"], r["variant"]): r for r in rows}
    for r in rows:
        f32 = base[r["shape"], "float32"]
        r["fwd_over_float32"] = round(r["fwd_ms"] / f32["fwd_ms"], 3)
        r["fwdbwd_over_float32"] = round(r["fwdbwd_ms"] / f32["fwdbwd_ms"], 3)
    return rows


def router_linear_report(rows, info, out):
    lines = ["# Router linear: float32 (today) against cheaper GEMMs, forward and forward + ∂x + ∂W", ""] \
        + stack_lines(info) + [
        "bf16 x `[T, d]`, float32 router weight `[E, d]` (the master weight of mixed-precision training), float32 "
        "`∂logits`. Median ms; '/ float32' below 1 = faster than today. TFLOP/s from 3 · 2·T·d·E. Relative L2 "
        "errors against float64 products of the same inputs. Which variants keep the top-k sets: "
        "`benchmarks/router_precision.py` (`router_precision_cpu.md`).", "",
        "| shape | variant | fwd ms | fwd / float32 | fwd+bwd ms | fwd+bwd / float32 | TFLOP/s | err logits | "
        "err ∂x | err ∂W |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} T{r['tokens']} d{r['d']} E{r['experts']} | {r['variant']} | {r['fwd_ms']:.4f} | "
                     f"{r['fwd_over_float32']:.3f} | {r['fwdbwd_ms']:.4f} | {r['fwdbwd_over_float32']:.3f} | "
                     f"{r['fwdbwd_tflops']} | {r['rel_err_logits']:.2e} | {r['rel_err_dx']:.2e} | "
                     f"{r['rel_err_dw']:.2e} |")
    lines += ["", "Variants:", ""] + [f"- `{k}`: {v[0]}" for k, v in router_linear_variants().items()]
    write(out, "router_linear", {"stack": info, "rows": rows}, lines)


# ----------------------------------------------------------------------------------------------------------
# experts
# ----------------------------------------------------------------------------------------------------------
SITU = GLUActivation("situ")


def make(n, hid, inter, e, dev, seed, skew=0.0):
    """bf16 activations and expert weights (float32 on the CPU: the interpreter mishandles bfloat16)."""
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(n, hid, device=dev, generator=g).to(dt)
    w1 = (torch.randn(e, 2 * inter, hid, device=dev, generator=g) * hid ** -0.5).to(dt)
    w2 = (torch.randn(e, hid, inter, device=dev, generator=g) * inter ** -0.5).to(dt)
    logits = torch.randn(n, e, device=dev, generator=g)
    if skew:
        logits = logits + skew * torch.randn(e, device=dev, generator=g)
    bias = (torch.randn(e, device=dev, generator=g) * 0.01).float()
    return x, w1, w2, logits.to(dt), bias


def loop_moe(x, logits, bias, w1, w2, k):
    """The model's PyTorch path: router op, then one matmul pair per expert."""
    idx, w, _, _ = moe_route_torch(logits, bias, k)
    return moe_experts_torch(x, idx, w, w1, w2, SITU)


def experts_correctness(n, hid, inter, e, k, dev, seed, drop):
    """bf16 kernels against the PyTorch experts in float32 on the same routing (slots dropped to E = EP)."""
    x, w1, w2, logits, bias = make(n, hid, inter, e, dev, seed)
    idx, wts, _, _ = moe_route(logits, bias, k)
    if drop:
        gen = torch.Generator(device=dev).manual_seed(seed + 1)
        idx = idx.masked_fill(torch.rand(idx.shape, device=dev, generator=gen) < drop, e)
    ps = [t.clone().requires_grad_() for t in (x, wts.detach().to(x.dtype), w1, w2)]
    out = moe_experts(ps[0], idx, ps[1], ps[2], ps[3])
    dout = torch.randn_like(out)
    out.backward(dout)
    qs = [t.detach().float().requires_grad_() for t in (x, wts, w1, w2)]
    ref = moe_experts_torch(qs[0], idx, qs[1], qs[2], qs[3], SITU)
    ref.backward(dout.float())
    errs = {"out": relative_error(out, ref)}
    for name, p, q in zip(["d_hidden", "d_weights", "d_gate_up", "d_down"], ps, qs, strict=True):
        errs[name] = relative_error(p.grad, q.grad)
    return errs


def experts_timing(name, n, hid, inter, e, k, skew, dev, with_loop, rep):
    x, w1, w2, logits, bias = make(n, hid, inter, e, dev, 1234, skew)
    ps = [t.clone().requires_grad_() for t in (x, w1, w2, logits)]
    dout = torch.randn(n, hid, device=dev, dtype=x.dtype)

    def ours():
        idx, w, _, _ = moe_route(ps[3], bias, k)
        return moe_experts(ps[0], idx, w, ps[1], ps[2])

    cands = [("ours", ours)]
    if dev.type == "cuda" and hasattr(torch, "_grouped_mm"):
        cands.append(("peer", lambda: grouped_mm_moe(ps[0], ps[3], bias, ps[1], ps[2], k)))
    if with_loop:
        cands.append(("loop", lambda: loop_moe(ps[0], ps[3], bias, ps[1], ps[2], k)))
    t = {}
    for cname, f in cands:
        with torch.no_grad():
            t[cname, "fwd"] = bench(f, dev, rep=rep)
        t[cname, "fwdbwd"] = bench(lambda f=f: f().backward(dout), dev, ps, rep)
    rows = []
    m = n * k
    for mode, flop in (("fwd", 6 * m * hid * inter), ("fwdbwd", 18 * m * hid * inter)):
        row = {"name": f"{name}_{mode}", **{f"{c}_ms": round(t[c, mode], 4) for c, _ in cands},
               "ours_tflops": round(flop / t["ours", mode] / 1e9, 1)}
        if ("peer", mode) in t:
            row["ours_over_peer"] = round(t["ours", mode] / t["peer", mode], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def experts_profile(name, n, hid, inter, e, k, dev):
    """Per-kernel CUDA time of one forward+backward of ours (torch.profiler), printed."""
    x, w1, w2, logits, bias = make(n, hid, inter, e, dev, 1234)
    ps = [t.clone().requires_grad_() for t in (x, w1, w2, logits)]
    dout = torch.randn(n, hid, device=dev, dtype=torch.bfloat16)

    def step():
        idx, w, _, _ = moe_route(ps[3], bias, k)
        moe_experts(ps[0], idx, w, ps[1], ps[2]).backward(dout)

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(f"profile {name} (one fwd+bwd):")
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=14, max_name_column_width=48))


def experts_bench(args, dev, info):
    if args.smoke:
        checks = [(48, 32, 16, 8, 2, 0, 0.1)]
        cases = [("E8_I16_k2", 48, 32, 16, 8, 2, 0.0)]
    else:
        # same (ℓ, I, k) as the timed cases, so the autotuned kernels are shared; slots dropped to E (EP)
        checks = [(4096, 2048, 512, 128, 8, 0, 0.1), (12288, 2048, 256, 512, 8, 1, 0.0),
                  (12288, 2048, 384, 896, 16, 2, 0.1)]
        cases = [("E128_I512_k8", 16384, 2048, 512, 128, 8, 0.0), ("E512_I256_k8", 16384, 2048, 256, 512, 8, 0.0),
                 ("E896_I384_k16", 16384, 2048, 384, 896, 16, 0.0),
                 ("E128_I512_k8_skewed", 16384, 2048, 512, 128, 8, 1.0)]
        if args.quick:
            cases = cases[:3]
    errs = {}
    for n, hid, inter, e, k, seed, drop in checks:
        errs[f"N{n}_l{hid}_I{inter}_E{e}_k{k}_drop{drop}"] = experts_correctness(n, hid, inter, e, k, dev, seed, drop)
        print("correctness", json.dumps(errs), flush=True)
    rows = []
    for name, n, hid, inter, e, k, skew in cases:
        rows += experts_timing(name, n, hid, inter, e, k, skew, dev, with_loop=not args.quick,
                               rep=3 if args.smoke else 100)
    if args.profile and dev.type == "cuda":
        for name, n, hid, inter, e, k, _ in cases[:3]:
            experts_profile(name, n, hid, inter, e, k, dev)
    lines = ["# MoE routed experts: ours vs torch._grouped_mm vs the model's PyTorch loop", ""] + stack_lines(info) + [
        "bf16, median ms; ours/peer below 1 = ours faster; TFLOP/s from 6·N·k·ℓ·I (fwd) and 18·N·k·ℓ·I (fwd+bwd), "
        f"against a {CEIL_TFLOPS:.0f} TFLOP/s bf16 GEMM ceiling.", "",
        "| case | ours ms | grouped_mm ms | loop ms | ours/peer | ours TFLOP/s | % of ceiling |",
        "|---|---|---|---|---|---|---|"]

    def fmt(v):
        return "-" if v is None else f"{v:.3f}"

    for r in rows:
        lines.append(f"| {r['name']} | {r['ours_ms']:.3f} | {fmt(r.get('peer_ms'))} | {fmt(r.get('loop_ms'))} | "
                     f"{fmt(r.get('ours_over_peer'))} | {r['ours_tflops']} | "
                     f"{100 * r['ours_tflops'] / CEIL_TFLOPS:.1f} |")
    lines += ["", "bf16 relative L2 errors against the PyTorch experts in float32:", ""]
    for c, ee in errs.items():
        lines.append(f"- {c}: " + ", ".join(f"{a} {b:.2e}" for a, b in ee.items()))
    write(args.out, "moe_experts", {"stack": info, "rows": rows, "errors": errs}, lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--router-only", action="store_true", help="only the router case")
    parser.add_argument("--router-linear", action="store_true",
                        help="only the router linear: float32 against TF32 and bf16 GEMMs (router_linear.*)")
    parser.add_argument("--quick", action="store_true", help="three experts cases, no loop peer")
    parser.add_argument("--profile", action="store_true", help="per-kernel profile of the experts (CUDA)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes; runs on the CPU under TRITON_INTERPRET=1")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"), help="results folder ($OUT)")
    args = parser.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu" and (not args.smoke or os.environ.get("TRITON_INTERPRET") != "1"):
        parser.error("no CUDA device: only --smoke with TRITON_INTERPRET=1 runs on the CPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    info = stack(dev)
    print(json.dumps(info), flush=True)
    t0 = time.time()
    if args.router_linear:
        shapes = [("tiny", 48, 32, 16), ("tiny_wide", 40, 64, 24)] if args.smoke else ROUTER_LINEAR_SHAPES
        router_linear_report(router_linear_rows(shapes, dev, rep=3 if args.smoke else 100), info, args.out)
        print(f"router linear took {time.time() - t0:.1f} s", flush=True)
        return
    if args.smoke:
        cases = [(64, 32, 16, 4), (40, 32, 32, 8)]
    else:
        cases = [(n, 1024, e, 8) for e in (64, 128) for n in (8192, 32768)]
    router_report(router_bench(cases, dev, rep=3 if args.smoke else 100), info, args.out)
    print(f"router took {time.time() - t0:.1f} s", flush=True)
    if not args.router_only:
        experts_bench(args, dev, info)
        print(f"all took {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
