"""Smoke test of ``benchmarks/bench_kimi_linear_gate.py --tiny --device cpu``: kdamoe's KDA layer with Kimi Linear's
unbounded gate against transformers' ``KimiLinearDeltaAttention`` at toy sizes, both on their PyTorch paths.

The script's ``main`` runs in the test's process. Checked: every case has a row with a finite time, the two layers
(same weights) agree in float32 in training and decode, and the files are written. Not how fast anything is.
"""

import json
import math
import os
import sys

import kdamoe  # noqa: F401  (imported first: the script then uses the real package)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from harness import load_script  # noqa: E402  (the benchmarks folder is not a package)


def test_bench_kimi_linear_gate_smoke_rows_agree(tmp_path):
    load_script("bench_kimi_linear_gate").main(["--tiny", "--device", "cpu", "--lengths", "40", "--batches", "2",
                                                "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "kimi_linear_gate.json").read_text())
    assert doc["settings"]["dtype"] == "torch.float32" and doc["settings"]["hidden"] == 64
    rows = {(r["part"], r["case"]): r for r in doc["rows"]}
    assert set(rows) == {("train", "T=40 / native"), ("train", "T=40 / kdamoe auto"),
                         ("decode", "B=2, state 40 / native"), ("decode", "B=2, state 40 / kdamoe auto")}
    for row in rows.values():
        assert math.isfinite(row["ms"]) and row["ms"] > 0, row
    for part, case in (("train", "T=40 / kdamoe auto"), ("decode", "B=2, state 40 / kdamoe auto")):
        assert rows[part, case]["rel_diff"] < 1e-5, rows[part, case]  # same weights, float32: the same layer
    assert "| train | T=40 / kdamoe auto |" in (tmp_path / "kimi_linear_gate.md").read_text()
