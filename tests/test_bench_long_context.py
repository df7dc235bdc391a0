"""Smoke test of ``benchmarks/bench_long_context.py --tiny`` on the CPU (the long-context benchmark).

The script's ``main`` runs in the test's process. Checked: every part recorded its numbers and no error; the rows
are the expected comparisons with finite times and ``ratio`` = ours / peer; both models' batched decode kept its
rows in agreement (each row of an expanded cache is a copy of one row, so a row that drifts points at a broken
expansion); the greedy check's two kdamoe paths (single pass + eager decode against chunked prefill + graph decode)
chose the same float32 tokens; no machine path is written. Not how fast anything is.
"""

import json
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from harness import load_script  # noqa: E402  (the benchmarks folder is not a package)


def test_bench_long_context_tiny_records_every_part(tmp_path):
    assert load_script("bench_long_context").main(["--tiny", "--device", "cpu", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "long_context.json").read_text()
    doc = json.loads(text)
    raw = doc["raw"]
    problems = {f"{g}/{k}": v for g, entries in raw.items() if isinstance(entries, dict)
                for k, v in entries.items() if isinstance(v, str) or (isinstance(v, dict) and "error" in v)}
    assert not problems, problems
    assert list(raw) == ["kdamoe", "native", "floor", "profile", "greedy"]

    names = [r["name"] for r in doc["rows"]]
    assert names == ["prefill 64", "prefill 256", "prefill 256 (kdamoe chunk 48)", "decode B=1 after 64",
                     "decode B=1 after 256", "decode B=8 after 64", "decode B=8 after 256",
                     "decode B=1 after 64: CUDA graph vs eager", "decode B=1 after 256: CUDA graph vs eager",
                     "prefill 256 vs its 1 MLA layers' causal attention alone", "native prefill 256 vs the same floor"]
    for row in doc["rows"]:
        for field in ("ours_ms", "peer_ms", "ratio"):
            assert isinstance(row[field], float) and math.isfinite(row[field]) and row[field] > 0, (row, field)
        assert math.isclose(row["ratio"], row["ours_ms"] / row["peer_ms"], rel_tol=1e-12)
    for model in ("kdamoe", "native"):
        for T in (64, 256):
            for batch in (1, 8):
                entry = raw[model][f"decode_b{batch}_T{T}"]
                assert entry["rows_agree"] is True, (model, batch, T, entry)
                assert len(entry["steps_ms"]) == doc["settings"]["steps"]
    greedy = raw["greedy"]["float32"]
    assert greedy["equal"] is True and greedy["tokens_a"] == greedy["tokens_b"], greedy
    assert len(greedy["tokens_a"]) == greedy["new_tokens"] == 6
    md = (tmp_path / "long_context.md").read_text()
    for saved in (text, md):
        assert str(tmp_path) not in saved and ROOT not in saved  # no path of this machine in a results file


def test_bench_long_context_refuses_an_unknown_part(capsys):
    with pytest.raises(SystemExit) as exit_:
        load_script("bench_long_context").parse_args(["--tiny", "--device", "cpu", "--only", "kdamoe,decode"])
    assert exit_.value.code == 2
    assert "unknown part(s) ['decode']" in capsys.readouterr().err
