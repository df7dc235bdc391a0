"""Tile and program-count sweep of the RMSNorm kernels (``kdamoe.kernels.norm``) at the model's two norm shapes.

    python benchmarks/tuning/tune_norm.py [--tokens 32768] [--hidden 1024] [--heads 8 --head-dim 128] [--out DIR]

The backward is a persistent kernel: ``BACKWARD_PROGRAMS_PER_SM`` programs per SM loop over row blocks of
``BLOCK_ELEMS`` elements and each writes one float32 ``dw`` partial row; its pipelining depth and warps are
autotuned (the row records the config the autotuner chose). It times ``norm_backward`` and ``norm_forward``
(``triton.testing.do_bench``, median ms) for each pair of those two module constants, on bf16 rows of
the hidden size (the decoder's pre-norms) and, gated, of the head dimension (the KDA output norm), and reports the
achieved bandwidth over the bytes the op must move (x, dout, dx, plus gate and dgate; forward: x, out, plus gate).
Writes ``norm_tune.json`` into ``--out`` ($OUT) after every row. Needs a GPU.
"""

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the harness
from harness import device_name, time_ms, write_json  # noqa: E402  (it puts the repo on the path)

from kdamoe.kernels.norm import backward as nb  # noqa: E402  (needs the repository on sys.path: harness)
from kdamoe.kernels.norm import forward as nf  # noqa: E402  (the same)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=1024, help="the e2e benchmark shape's hidden size")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tune_norm.py needs a GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    cases = (("hidden", a.tokens, a.hidden, False), ("gated head", a.tokens * a.heads, a.head_dim, True))
    for name, n, D, gated in cases:
        sweep(name, n, D, gated, gen, rows, a.out)
    _write(a.out, rows)


def sweep(name: str, n: int, D: int, gated: bool, gen: torch.Generator, rows: list, out: str) -> None:
    """Time the backward and forward at every pair of the two module constants on ``n`` bf16 rows of ``D``
    (``gated``: with a gate), appending a row to ``rows`` (and writing them to ``out``) after each pair."""
    x = torch.randn(n, D, device="cuda", generator=gen).bfloat16()
    g = torch.randn(n, D, device="cuda", generator=gen).bfloat16() if gated else None
    w = torch.rand(D, device="cuda", generator=gen).bfloat16() + 0.5
    dout = torch.randn(n, D, device="cuda", generator=gen).bfloat16()
    moved = (n * D * 2 * (5 if gated else 3), n * D * 2 * (3 if gated else 2))  # backward, forward (bytes)

    def backward():
        return nb.norm_backward(x, g, w, dout, 1e-6, torch.bfloat16)

    def forward():
        return nf.norm_forward(x, g, w, 1e-6, torch.bfloat16, torch.bfloat16)

    for per_sm, elems in itertools.product((4, 8, 16), (2048, 4096, 8192)):
        # backward.py binds BLOCK_ELEMS from forward.py at import: set the tile size in both modules
        nb.BACKWARD_PROGRAMS_PER_SM, nb.BLOCK_ELEMS, nf.BLOCK_ELEMS = per_sm, elems, elems
        nb._backward_kernel.autotuner.cache.clear()  # its key has no program count: tune again for this one
        try:
            # do_bench's defaults (25 ms warm-up, 100 ms of repetitions, the mean), as this sweep always used
            bwd = time_ms(backward, True, mode="mean")
            fwd = time_ms(forward, True, mode="mean")
        except Exception as e:  # e.g. out of resources at a large tile
            rows.append({"shape": name, "per_sm": per_sm, "block_elems": elems, "error": repr(e)[:200]})
            continue
        best = nb._backward_kernel.autotuner.best_config
        row = {"shape": name, "rows": n, "D": D, "per_sm": per_sm, "block_elems": elems,
               "backward_config": {**best.kwargs, "num_warps": best.num_warps},
               "bwd_ms": bwd, "bwd_tb_s": moved[0] / bwd / 1e9, "fwd_ms": fwd, "fwd_tb_s": moved[1] / fwd / 1e9}
        rows.append(row)
        print(json.dumps(row), flush=True)
        _write(out, rows)


def _write(out: str, rows: list) -> None:
    """``norm_tune.json`` after every row, through a ``.tmp`` and a rename: a killed sweep keeps what it measured."""
    write_json(os.path.join(out, "norm_tune.json"), {"device": device_name(True), "rows": rows})


if __name__ == "__main__":
    main()
