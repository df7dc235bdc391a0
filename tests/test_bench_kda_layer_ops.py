"""Smoke test of ``benchmarks/bench_kda_layer_ops.py --smoke`` on the CPU under the Triton interpreter (the KDA
layer's short conv and gate).

The script's ``main`` runs in the test's process at one length. Checked: every variant has a row with finite times;
the Triton conv, whole and as the layer calls it, matches the PyTorch tap loop (the reference: independent code) in
float32; the two gate variants agree. Not how fast anything is.
"""

import json
import math
import os
import sys

import kdamoe  # noqa: F401  (imported first: the script then uses the real package, not its kernels-only stand-in)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from harness import load_script  # noqa: E402  (the benchmarks folder is not a package)


def test_bench_kda_layer_ops_smoke_rows_agree(tmp_path):
    load_script("bench_kda_layer_ops").main(["--smoke", "--lengths", "64", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "layer_ops.json").read_text())
    assert doc["meta"]["device"] == "cpu (interpreter smoke)" and doc["meta"]["dtype"] == "torch.float32"
    rows = {(r["op"], r["variant"]): r for r in doc["rows"]}
    assert set(rows) >= {("conv", "triton (ours)"), ("conv", "triton (ours), q/k/v parts (as the layer)"),
                         ("conv", "torch loop"), ("gate", "kda_gate (torch) + chunk_kda"),
                         ("gate", "chunk_kda(use_gate_in_kernel)")}
    for row in doc["rows"]:
        assert row["T"] == 64 and "skipped" not in row["note"], row
        if row["variant"] == "fla":
            continue
        assert math.isfinite(row["fwd_ms"]) and math.isfinite(row["fwd_bwd_ms"]), row
    for variant in ("triton (ours)", "triton (ours), q/k/v parts (as the layer)"):
        assert rows["conv", variant]["err"] < 1e-5, rows["conv", variant]  # float32 against the PyTorch loop
    assert rows["gate", "chunk_kda(use_gate_in_kernel)"]["err"] < 1e-5
    assert "| conv | triton (ours) | 64 |" in (tmp_path / "layer_ops.md").read_text()
