"""Smoke test of ``benchmarks/bench_k3_gpu.py --device cpu``: the script's plumbing without a GPU or NeMo.

The script's ``main`` runs in the test's process on the tiny K3 fixture: kdamoe's K3 loader in float32 on the CPU,
compared with the float32 logits NeMo's K3 wrote into the fixture (``tests/fixtures/k3_tiny/reference.safetensors``,
computed by NeMo, not by kdamoe). Checked: that row is within the CPU test's bar, NeMo's rows and the large part are
recorded as skipped (they need CUDA), no error is recorded, and the files are written. The GPU comparison itself
runs on the device (``benchmarks/device_k3_gpu.sh``).
"""

import json
import os
import sys

import pytest

import kdamoe  # noqa: F401  (imported first: the script then uses the real package)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from harness import load_script  # noqa: E402  (the benchmarks folder is not a package)


def test_bench_k3_gpu_cpu_smoke(tmp_path):
    assert load_script("bench_k3_gpu").main(["--device", "cpu", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "k3_gpu.json").read_text())
    raw = doc["raw"]
    errors = {f"{g}/{k}": v for g, entries in raw.items() for k, v in entries.items()
              if isinstance(v, dict) and "error" in v}
    assert not errors, errors
    row = raw["fixture"]["kdamoe fp32 vs fixture fp32"]
    assert row["max_abs_ref"] > 1.0  # the fixture's logits, not an empty tensor
    assert row["rel_max_diff"] < 1e-5, row  # tests/test_kimi_k3_checkpoints.py's bar
    assert raw["fixture"]["NeMo bf16 vs fixture fp32"].startswith("skipped")
    assert raw["fixture"]["kdamoe bf16 vs NeMo bf16"].startswith("skipped")
    assert raw["large"]["part"].startswith("skipped")
    assert [r["case"] for r in doc["rows"]] == ["kdamoe fp32 vs fixture fp32"]
    assert "| fixture | kdamoe fp32 vs fixture fp32 |" in (tmp_path / "k3_gpu.md").read_text()


def test_bench_k3_gpu_refuses_a_folder_without_reference(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        load_script("bench_k3_gpu").parse_args(["--device", "cpu", "--fixture", str(tmp_path)])
    assert exit_.value.code == 2
    assert "reference.safetensors" in capsys.readouterr().err
