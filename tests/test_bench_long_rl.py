"""Smoke test of ``benchmarks/bench_long_rl.py --tiny`` on the CPU (issue #16's million-token RL benchmark).

The script's ``main`` runs in the test's process. Checked: every part recorded its numbers and no error; at every
context the cached turn generated the same greedy tokens as the TRL loop's re-prefill (the re-prefill is the
reference: it shares no cache with the cached path); the GRPO steps ran with finite losses; and the ``turns`` rows'
ratios are the recorded seconds' quotients. Not how fast anything is.
"""

import json
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from harness import load_script  # noqa: E402  (the benchmarks folder is not a package)


def test_bench_long_rl_tiny_records_every_part(tmp_path):
    assert load_script("bench_long_rl").main(["--tiny", "--device", "cpu", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "long_rl.json").read_text()
    doc = json.loads(text)
    raw = doc["raw"]
    errors = {f"{g}/{k}": v for g, entries in raw.items() if isinstance(entries, dict)
              for k, v in entries.items() if isinstance(v, dict) and "error" in v}
    assert not errors, errors

    assert list(raw["turns"]) == ["64", "256", "1K"]
    for entry in raw["turns"].values():
        assert entry["same_tokens"] is True, entry
        assert entry["matching_tokens"] == doc["settings"]["gen_tokens"], entry
        assert len(entry["cached_turns_s"]) == doc["settings"]["repeats"]
        assert all(math.isfinite(s) and s > 0 for s in entry["cached_turns_s"] + [entry["trl_s"]])
    for row in doc["rows"]:
        turn = raw["turns"][row["name"].removeprefix("turn after ")]
        assert math.isclose(row["cached_over_trl"], turn["cached_s"] / turn["trl_s"], rel_tol=1e-12)

    traj = raw["trajectory"]
    assert len(traj["cached_cum_s"]) == len(traj["trl_cum_s"]) == len(traj["context"]) == 3
    assert traj["context"] == sorted(traj["context"])

    update = raw["update"]
    for key in ("ours 2 x 96", "ours no-grad pass 2 x 96", "trl defaults 2 x 64", "trl defaults 2 x 128"):
        assert math.isfinite(update[key]["s"]) and update[key]["tokens"] > 0, (key, update[key])
    for key in ("ours 2 x 96", "trl defaults 2 x 64"):
        assert math.isfinite(update[key]["loss"]), update[key]
    assert update["trl defaults longest"] == "128"
    assert str(tmp_path) not in text and ROOT not in text  # no path of this machine in a results file


def test_bench_long_rl_refuses_contexts_the_played_turns_overrun():
    """A context must lie past the one before plus the turns played there (it once failed with a negative
    dimension on the device when a context repeated)."""
    bench = load_script("bench_long_rl")
    for contexts in ("64,64,1024", "64,80", "256,64"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--tiny", "--device", "cpu", "--contexts", contexts])
    assert bench.parse_args(["--tiny", "--device", "cpu", "--contexts", "64,91"]).contexts == [64, 91]
