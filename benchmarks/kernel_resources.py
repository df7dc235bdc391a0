"""Registers, spills, stack and shared memory of the KDA forward kernels for sm_90, without a GPU.

Compiles each kernel with the local Triton (its own ptxas) for an H100/H200 target and reads the
resource usage that ``cuobjdump --dump-resource-usage`` reports for the cubin, plus Triton's shared
memory figure. Costs no device time; the GPU's Triton (3.6) may allocate a little differently.

    python benchmarks/kernel_resources.py [--warps 4,8]
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def jit_fn(kernel):
    """The JITFunction under autotune / heuristics wrappers."""
    while not isinstance(kernel, triton.runtime.JITFunction):
        kernel = kernel.fn
    return kernel


def usage(kernel, signature, constexprs, num_warps, num_stages=2, maxnreg=None):
    fn = jit_fn(kernel)
    names = fn.arg_names
    sig = {n: signature.get(n, "constexpr") for n in names}
    cst = {(names.index(n),): v for n, v in constexprs.items()}
    src = ASTSource(fn=fn, signature=sig, constexprs=cst)
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps,
                                                                          "num_stages": num_stages,
                                                                          "maxnreg": maxnreg})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as fh:
        fh.write(ck.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    out = subprocess.run([tool, "--dump-resource-usage", fh.name], capture_output=True, text=True).stdout
    os.unlink(fh.name)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    regs, stack = (int(m.group(1)), int(m.group(2))) if m else (None, None)
    return {"regs": regs, "stack": stack, "shared": ck.metadata.shared}


def kda_forward_specs(K=128, V=128, dt="bf16"):
    from bench_kda import kernels_without_model_registry
    kernels_without_model_registry()
    from kdamoe.kernels.kda import intra, output, prepare, state
    idx = {"chunk_idx": "*i32", "cu_seqlens": "*i32"}
    yield "prepare", prepare._prepare_fwd_kernel, {
        "q": f"*{dt}", "k": f"*{dt}", "g": f"*{dt}", "qn": f"*{dt}", "kn": f"*{dt}", "rq": "*fp32", "rk": "*fp32",
        "G": "*fp32", "A_log": "*fp32", "dt_bias": "*fp32", "lower_bound": "fp32", **idx}, dict(
        H=16, K=K, BT=64, USE_L2=True, GATE_IN=True, HAS_A=False, HAS_BIAS=True)
    yield "intra", intra._intra_fwd_kernel, {
        "q_in": f"*{dt}", "k_in": f"*{dt}", "g_in": f"*{dt}", "A_log": "*fp32", "dt_bias": "*fp32",
        "q": f"*{dt}", "k": f"*{dt}", "rq": "*fp32", "rk": "*fp32", "G": "*fp32", "v": f"*{dt}", "beta": f"*{dt}",
        "Aqk": f"*{dt}", "Mb": "*fp32", "w": f"*{dt}", "u": f"*{dt}", "kg": f"*{dt}",
        "qg": f"*{dt}",
        "scale": "fp32", "lower_bound": "fp32", **idx}, dict(
        H=16, K=K, V=V, BT=64, BS=16, USE_L2=True, GATE_IN=True, HAS_A=False, HAS_BIAS=True)
    yield "state_fwd", state._state_fwd_kernel, {
        "w": f"*{dt}", "u": f"*{dt}", "kg": f"*{dt}", "G": "*fp32", "h": f"*{dt}", "vnew": f"*{dt}", "h0": "*fp32",
        "ht": "*fp32", "cu_seqlens": "*i32", "chunk_offsets": "*i32"}, dict(
        H=16, K=K, V=V, BT=64, BV=32, HAS_H0=False, STORE_FINAL=False)
    yield "output", output._output_fwd_kernel, {
        "qg": f"*{dt}", "h": f"*{dt}", "vnew": f"*{dt}", "Aqk": f"*{dt}", "o": f"*{dt}", **idx}, dict(
        H=16, K=K, V=V, BT=64, BV=64)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--only", default="")
    ap.add_argument("--maxnreg", type=int, default=None)
    ap.add_argument("--stages", type=int, default=3)
    args = ap.parse_args()
    for name, kern, sig, cst in kda_forward_specs():
        if args.only and name not in args.only.split(","):
            continue
        for w in [int(x) for x in args.warps.split(",")]:
            try:
                print(f"{name:10s} warps={w}: {usage(kern, sig, cst, w, args.stages, args.maxnreg)}", flush=True)
            except Exception as e:  # report and go on
                print(f"{name:10s} warps={w}: failed {type(e).__name__}: {str(e)[:300]}")


if __name__ == "__main__":
    main()
