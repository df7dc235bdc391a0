"""Registers, spills and pipelining of the routed experts' GEMM kernels for Hopper, compiled on a machine without a GPU.

    python benchmarks/kernel_resources.py [--tokens 32768 --experts 64 --latent 1024 --inter 512 --top-k 8] [--out DIR]
    python benchmarks/kernel_resources.py --family conv [--tokens 32768 --channels 1024 --row-stride 3344 --width 4]

For every call ``kdamoe.kernels.moe.experts.MoEExpertsFunction`` makes (forward gate/up, forward down, backward
∂g' = ∂out[tok] @ W2 stored at the sorted row (``dg``), the element-wise GLU backward after it (``glu_rows_bwd``, its
one fixed config), backward ∂x, the two weight gradients) and every config in that kernel's autotune list, it
compiles the kernel for sm_90a (``triton.compile`` with a ``GPUTarget``; the ptxas shipped in the Triton wheel
assembles it) with the argument specialisation a launch at the given shape gets (integers equal to 1 become
constants, multiples of 16 carry the divisibility hint), and reports what ``ptxas -v`` says: registers per thread
and spill bytes, plus the shared memory Triton reserved (one stage or several) and whether the PTX uses ``cp.async``
(software pipelining) and ``wgmma`` (Hopper's warpgroup MMA). A kernel that spills or is not pipelined is on a slow
path before it runs; the GPU's autotuner then only chooses among the configs listed. Timing needs the GPU
(``benchmarks/tune_moe_rows.py``).

Facts only about the compiler this machine has (the Triton version printed in the output); the GPU may run
another. Writes ``kernel_resources.{json,md}`` into ``--out``.

``--family conv`` does the same for the short conv's kernels (``kdamoe.kernels.conv``: forward, and the backward's
dpre and dx kernels) at one bf16 launch of the KDA layer's training step: x the q|k|v column slice (three parts of
``--channels``) with row stride ``--row-stride``, packed documents (``seq_idx``), no cached state.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime import JITFunction

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("kernel_resources.py compiles for the GPU: unset TRITON_INTERPRET")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the harness
from harness import add_moe_shape_args, write_json, write_text  # noqa: E402  (it puts the repo on the path)

from kdamoe.kernels.conv import backward as conv_backward  # noqa: E402  (needs the repository on sys.path: harness)
from kdamoe.kernels.conv import forward as conv_forward  # noqa: E402  (the same)
from kdamoe.kernels.launch import FastLaunch  # noqa: E402  (the same)
from kdamoe.kernels.moe import grouped_gemm as gg  # noqa: E402  (the same)
from kdamoe.kernels.moe.experts import GLU_COLS, GLU_ROWS  # noqa: E402  (the same)

TARGET = GPUTarget("cuda", 90, 32)
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def compile_report(kernel, types: dict, consts: dict, ints: dict, config) -> dict:
    """Compile ``kernel`` (the function under its autotuner, if any) with one ``triton.Config`` and return
    ptxas's resource report.

    ``types`` maps pointer/float arguments to Triton type strings; ``ints`` gives the integer arguments' values
    at the shape (for the launch's specialisation); ``consts`` the constexpr arguments besides the config's.
    """
    if isinstance(kernel, FastLaunch):  # kdamoe.kernels.launch's wrapper: the kernel it launches
        kernel = kernel.kernel
    fn = kernel if isinstance(kernel, JITFunction) else kernel.fn  # a JITFunction's own .fn is the Python function
    consts = {**consts, **config.kwargs}
    div16 = [n for n, t in types.items() if t.startswith("*")]
    for name, value in ints.items():
        if value == 1:
            consts[name] = 1
        elif value % 16 == 0:
            div16.append(name)
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
    k = triton.compile(ASTSource(fn, sig, consts, attrs=attrs), target=TARGET,
                       options={"num_warps": config.num_warps, "num_stages": config.num_stages})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    res = subprocess.run([PTXAS, "-v", "-arch=sm_90a", f.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spill = re.search(r"(\d+) bytes spill stores", res.stderr)
    return {"smem": k.metadata.shared, "cp_async": "cp.async" in k.asm["ptx"], "wgmma": "wgmma" in k.asm["ptx"],
            "regs": int(regs.group(1)) if regs else None, "spill_bytes": int(spill.group(1)) if spill else None}


def calls(n: int, e: int, L: int, inter: int, k: int) -> list[tuple]:
    """``(name, kernel, types, constexprs, integer values, configs)`` of every experts kernel launch of one forward +
    backward but the combine; ``configs`` is the autotune list, or the one config ``experts.py`` launches with."""
    row_t = {"a_ptr": "*bf16", "b_ptr": "*bf16", "order_ptr": "*i32", "tile_expert_ptr": "*i32",
             "tile_offs_ptr": "*i32", "row_offs_ptr": "*i32", "out_ptr": "*bf16"}
    glu_t = {"dg_ptr": "*bf16", "h_ptr": "*bf16", "order_ptr": "*i32", "row_offs_ptr": "*i32", "w_ptr": "*fp32",
             "dh_ptr": "*bf16", "dw_ptr": "*fp32", "beta1": "fp32", "beta2": "fp32"}
    gu_t = {"x_ptr": "*bf16", "w_ptr": "*bf16", "order_ptr": "*i32", "tile_expert_ptr": "*i32",
            "tile_offs_ptr": "*i32", "row_offs_ptr": "*i32", "rw_ptr": "*fp32", "g_ptr": "*bf16", "h_ptr": "*bf16",
            "beta1": "fp32",
            "beta2": "fp32"}
    wg_t = {"a_ptr": "*bf16", "b_ptr": "*bf16", "order_ptr": "*i32", "row_offs_ptr": "*i32", "experts_ptr": "*i32",
            "out_ptr": "*bf16"}
    m = n * k
    bm = 128 if m >= 192 * e else 64  # experts._block_m
    act = {"ACT": 0, "PREC": "tf32", "BM": bm}
    rows_cfgs = gg._rows_gemm_kernel.configs
    glu_cfg = [triton.Config({"BR": GLU_ROWS, "BI": GLU_COLS}, num_warps=4)]  # experts._glu_rows_bwd's launch

    def rows(ga, so, n_out, k_dim, sam, sbe, sbk, sbn):
        return ({"PREC": "tf32", "BM": bm, "GATHER_A": ga, "SORTED_OUT": so},
                {"E": e, "N_OUT": n_out, "K_DIM": k_dim, "TOPK": k, "stride_am": sam, "stride_be": sbe,
                 "stride_bk": sbk, "stride_bn": sbn}, rows_cfgs)

    return [
        ("gate_up", gg._gate_up_fwd_kernel, gu_t, {**act, "SAVE_H": True, "TOPK": k}, {"E": e, "I": inter, "L": L},
         gg._gate_up_fwd_kernel.configs),
        ("down", gg._rows_gemm_kernel, row_t, *rows(False, False, L, inter, inter, L * inter, 1, inter)),
        ("dg", gg._rows_gemm_kernel, row_t, *rows(True, True, inter, L, L, L * inter, inter, 1)),
        ("glu_rows_bwd", gg._glu_rows_bwd_kernel, glu_t, {"ACT": 0}, {"M": m, "E": e, "I": inter}, glu_cfg),
        ("dx", gg._rows_gemm_kernel, row_t, *rows(False, False, L, 2 * inter, 2 * inter, 2 * inter * L, L, 1)),
        ("dw1", gg._wgrad_kernel, wg_t, {"GATHER_A": False, "GATHER_B": True, "PREC": "tf32", "TOPK": k},
         {"E": e, "P": 2 * inter, "Q": L, "stride_am": 2 * inter, "stride_bm": L}, gg._wgrad_kernel.configs),
        ("dw2", gg._wgrad_kernel, wg_t, {"GATHER_A": True, "GATHER_B": False, "PREC": "tf32", "TOPK": k},
         {"E": e, "P": L, "Q": inter, "stride_am": L, "stride_bm": inter}, gg._wgrad_kernel.configs),
    ]


def conv_calls(n: int, cp: int, sx: int, W: int) -> list[tuple]:
    """``(name, kernel, types, constexprs, integer values, configs)`` of the short conv's launches (forward, and the two
    backward kernels) as the KDA layer makes them: its q|k|v (three parts of ``cp`` channels, one bf16 column slice of
    ``n`` tokens with row stride ``sx``), packed documents, no cached state."""
    C = 3 * cp
    flags = {"W": W, "PARTS": 3, "HAS_STATE": False, "HAS_SEQ": True, "state": None}
    nt = -(-n // conv_backward.BT_DX)

    def parts(name: str) -> dict:
        return {f"{name}{i}": "*bf16" for i in range(3)}

    dx_types = {"dpre": "*bf16", "x": "*bf16", "weight": "*bf16", "seq_idx": "*i64", "dx": "*bf16", "dw_part": "*fp32"}
    dx_ints = {"T": n, "C": C, "SX": sx, "NT": nt}
    return [
        ("conv_fwd", conv_forward._conv_fwd_kernel,
         {"x": "*bf16", "weight": "*bf16", "seq_idx": "*i64", **parts("y")}, flags,
         {"T": n, "C": C, "CP": cp, "SX": sx}, conv_forward._conv_fwd_kernel.configs),
        ("conv_bwd_dpre", conv_backward._conv_bwd_dpre_kernel,
         {"x": "*bf16", "weight": "*bf16", "seq_idx": "*i64", **parts("dy"), "dpre_out": "*bf16"},
         flags, {"T": n, "C": C, "CP": cp, "SX": sx}, conv_backward._conv_bwd_dpre_kernel.configs),
        ("conv_bwd_dx", conv_backward._conv_bwd_dx_kernel, dx_types,
         {"W": W, "BT": conv_backward.BT_DX, "HAS_STATE": False, "HAS_SEQ": True, "STATE_GRAD": False, "state": None,
          "dstate": None}, dx_ints, conv_backward._conv_bwd_dx_kernel.configs),
        # a cached state and its gradient (a forward with grad that continues a cache): the interpreter does not
        # type-check branches, and triton 3.6 (the GPU's) once refused this one where 3.7 compiled it; run the
        # script with 3.6 too
        ("conv_bwd_dx state grad", conv_backward._conv_bwd_dx_kernel,
         {**dx_types, "state": "*bf16", "dstate": "*fp32"},
         {"W": W, "BT": conv_backward.BT_DX, "HAS_STATE": True, "HAS_SEQ": True, "STATE_GRAD": True}, dx_ints,
         conv_backward._conv_bwd_dx_kernel.configs[:1]),
    ]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_moe_shape_args(p)
    p.add_argument("--only", default=None, help="comma-separated call names (gate_up,down,dg,glu_rows_bwd,dx,dw1,dw2)")
    p.add_argument("--family", choices=("moe", "conv"), default="moe", help="the experts' GEMMs or the short conv")
    p.add_argument("--channels", type=int, default=1024, help="conv: channels C of one q / k / v part")
    p.add_argument("--row-stride", type=int, default=3344, help="conv: x's token stride (its fused projection's width)")
    p.add_argument("--width", type=int, default=4, help="conv: kernel width W")
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    a = p.parse_args()
    rows = []
    if a.family == "conv":
        launches = conv_calls(a.tokens, a.channels, a.row_stride, a.width)
        shape = {"tokens": a.tokens, "channels": a.channels, "row_stride": a.row_stride, "width": a.width}
        title = "Short conv kernels"
    else:
        launches = calls(a.tokens, a.experts, a.latent, a.inter, a.top_k)
        shape = {"tokens": a.tokens, "experts": a.experts, "latent": a.latent, "inter": a.inter, "top_k": a.top_k}
        title = "Experts kernels"
    for name, kernel, types, consts, ints, configs in launches:
        if a.only and name not in a.only.split(","):
            continue
        for cfg in configs:
            row = {"call": name, "config": {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
                   **compile_report(kernel, types, consts, ints, cfg)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    shape = {**shape, "triton": triton.__version__, "target": "sm_90a"}
    os.makedirs(a.out, exist_ok=True)
    write_json(os.path.join(a.out, "kernel_resources.json"), {"shape": shape, "rows": rows})
    lines = [f"# {title} compiled for sm_90a: {shape}", "",
             "| call | config | regs | spill bytes | smem KB | cp.async | wgmma |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        cfg = " ".join(f"{k}={v}" for k, v in r["config"].items())
        lines.append(f"| {r['call']} | {cfg} | {r['regs']} | {r['spill_bytes']} | {r['smem'] / 1024:.0f} | "
                     f"{r['cp_async']} | {r['wgmma']} |")
    write_text(os.path.join(a.out, "kernel_resources.md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
