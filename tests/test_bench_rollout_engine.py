"""Smoke test of ``benchmarks/bench_rollout_engine.py --tiny --device cpu`` (issue #39's rollout benchmark).

The script's ``main`` runs in the test's process. Checked: both parts recorded their numbers and no error; in the
round every way played every episode to the forced length, and the cached rollout and TRL's own loop (float32,
greedy, each sharing nothing with the engine) produced the engine's tokens for every episode; the engine's counters
are the ones the round's shape implies (counted here by hand from the settings); the cost model's counts of the
cached rollout's forwards; a peer cut short by its time share is projected from what it measured. Not how fast
anything is.
"""

import json
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from harness import load_script  # noqa: E402  (the benchmarks folder is not a package)

TINY = ["--tiny", "--device", "cpu", "--contexts", "48"]


def _errors(raw: dict) -> dict:
    found = {}
    for group, entries in raw.items():
        for key, value in entries.items():
            if isinstance(value, dict) and "error" in value:
                found[f"{group}/{key}"] = value
            elif isinstance(value, dict):
                found.update({f"{group}/{key}/{w}": v for w, v in value.items()
                              if isinstance(v, dict) and "error" in v})
    return found


def test_bench_rollout_engine_tiny_records_both_parts(tmp_path):
    assert load_script("bench_rollout_engine").main(TINY + ["--step-slots", "1,4", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "rollout_engine.json").read_text()
    doc = json.loads(text)
    raw, s = doc["raw"], doc["settings"]
    assert not _errors(raw), _errors(raw)

    # tiny defaults: 2 prompts x 2 generations, 3 turns of 4 tokens, 5 tool-result tokens, a 48-token prompt
    P, G, n, gen, R, C = s["prompts"], s["generations"], s["turns"], s["gen_tokens"], s["result_tokens"], 48
    assert (P, G, n, gen, R) == (2, 2, 3, 4, 5)
    E = P * G
    budget = n * gen + (n - 1) * R  # 22: every episode runs to the end of its last turn
    round_ = raw["round"]["48"]
    for way in ("engine", "cached", "trl"):
        e = round_[way]
        assert e["completion_lengths"] == [budget], (way, e)
        assert e["projected"] is False and math.isfinite(e["round_s"]) and e["round_s"] > 0
        assert math.isclose(e["tokens_per_s"], E * n * gen / e["round_s"], rel_tol=1e-12)
    for way in ("cached", "trl"):
        assert round_[way]["same_tokens_as_engine"] == round_[way]["same_tokens_of"] == E, round_[way]
    stats = round_["engine"]["stats"]
    # the prompt once per group; per later turn the last sampled token + the tool turn; gen - 1 decodes per turn
    assert stats["prefill_tokens"] == P * C + E * (n - 1) * (R + 1)
    assert stats["decode_tokens"] == E * n * (gen - 1)
    assert (stats["forks"], stats["tool_rounds"]) == (P, E * (n - 1))
    assert round_["engine"]["ended"] == ["iterations"]
    # one 48-token prefill forward, then (gen - 1) decodes per turn and one tool-turn forward per later turn
    assert round_["cached"]["forwards"] == E * (1 + n * (gen - 1) + (n - 1))
    assert len(round_["cached"]["episodes_s"]) == E and len(round_["trl"]["turns_s"]) == n

    steps = raw["steps"]
    assert list(steps) == ["warm-up 2 slots after 32", "1 slots after 64", "4 slots after 64"]
    for key, e in steps.items():
        profiled = s["profile_steps"] if key == "4 slots after 64" else 0  # the largest count: steps profiled apart
        assert e["step_ms"] > 0 and len(e["step_ms_all"]) == s["step_tokens"] - 1 - profiled, (key, e)
        assert e["forward_ms"] <= e["step_ms"]  # the forward is part of the step
    profile = steps["4 slots after 64"]["profile"]
    assert profile["steps"] == s["profile_steps"] == 1 and profile["host_top"], profile
    assert (steps["4 slots after 64"]["groups"], steps["1 slots after 64"]["groups"]) == (2, 1)
    fit = doc["notes"]["fit"]
    assert fit["points"] == 3  # one per run: the medians of its decode steps
    assert all(math.isfinite(fit[k]) for k in ("a_ms", "b_us_per_token", "c_ns_per_row"))
    assert "predicted_s" in round_["engine"]
    assert str(tmp_path) not in text and ROOT not in text  # no path of this machine in a results file


def test_bench_rollout_engine_projects_a_peer_past_its_time_share(tmp_path):
    """A peer past its time share plays one unit (an episode, a turn) and is projected from it; the round's
    predictions come from the fit of the earlier file it extends (``--continue-from``): a·forwards + b·tokens +
    c·rows."""
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"notes": {"fit": {"a_ms": 2.0, "b_us_per_token": 30.0, "c_ns_per_row": 5.0,
                                                     "points": 5, "max_rel_residual": 0.1}}}))
    out = tmp_path / "out"
    bench = load_script("bench_rollout_engine")
    assert bench.main(TINY + ["--only", "round", "--peer-s", "1e-9", "--continue-from", str(earlier),
                              "--out", str(out)]) == 0
    round_ = json.loads((out / "rollout_engine.json").read_text())["raw"]["round"]["48"]
    for way in ("engine", "cached", "trl"):
        e = round_[way]
        assert math.isclose(e["predicted_s"], 2e-3 * e["forwards"] + 30e-6 * e["tokens"] + 5e-9 * e["rows"],
                            rel_tol=1e-9), (way, e)
    cached, trl = round_["cached"], round_["trl"]
    assert cached["projected"] and cached["episodes_measured"] == 1
    assert math.isclose(cached["round_s"], 4 * cached["episodes_s"][0], rel_tol=1e-12)
    assert trl["projected"] and trl["turns_measured"] == 1
    assert math.isclose(trl["round_s"], 3 * trl["turns_s"][0], rel_tol=1e-12)
    assert round_["engine"]["projected"] is False


@pytest.mark.parametrize("bad", [["--ways", "cached,engine"], ["--ways", "vllm"], ["--step-tokens", "1"],
                                 ["--prompts", "0"], ["--peer-s", "0"], ["--step-slots", "0,8"]])
def test_bench_rollout_engine_refuses_bad_arguments(bad):
    with pytest.raises(SystemExit):
        load_script("bench_rollout_engine").parse_args(["--tiny", "--device", "cpu"] + bad)
