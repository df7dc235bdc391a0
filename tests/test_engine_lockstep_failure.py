"""Ranks of a ``lockstep_group`` fail together (``RolloutEngine.run``, docs/post-training.md, "Several processes"):
a rank whose ``run`` raises announces it in the step's all-reduce, so the other ranks raise a RuntimeError naming it
within one step instead of waiting in the all-reduce until the process group times out.

One ``torchrun --nproc_per_node 2`` run of this file (gloo, a 30 s process-group timeout, in the ``distributed``
xdist group) plays three cases on an unsharded tiny model per rank; in each, rank 0 decodes episodes long enough to
outlast rank 1 by many steps, while rank 1 fails:

* ``bad_prompt``: rank 1's prompt holds an id outside the vocabulary (a ValueError before its first step);
* ``tool``: rank 1's ``tool_suffix_ids`` raises after its first turn (a failure between steps);
* ``sampling``: a logits processor raises on rank 1 at its 3rd sampling (a failure after a step's forward).

Each rank writes what it raised and how many steps it ran; the test checks rank 1 raised its own error, rank 0 a
RuntimeError naming rank 1, rank 0 no more than one step after rank 1's last, and the run ending well before the
process-group timeout (a rank left waiting would sit in the all-reduce for the whole 30 s).
"""

import datetime
import json
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import GenerationConfig, LogitsProcessorList

from kdamoe import KDAMoEForCausalLM
from kdamoe.posttraining.engine import EpisodeSpec, RolloutEngine
from tests.helpers import launch_processes, tiny_config

CASES = ("bad_prompt", "tool", "sampling")
PG_TIMEOUT_S, DEADLINE_S = 30, 120


class _RaiseAt:
    """A logits processor that raises at its ``n``-th call (and leaves the scores alone before)."""

    def __init__(self, n: int):
        self.n, self.calls = n, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls >= self.n:
            raise RuntimeError("processor failed on purpose")
        return scores


def _case(case: str, rank: int, model) -> dict:
    long_turn = 40  # rank 0: many more steps than rank 1 runs before it fails
    processors = LogitsProcessorList([_RaiseAt(3)]) if case == "sampling" and rank == 1 else None

    def suffix(messages):
        if rank == 1:
            raise RuntimeError("tool_suffix_ids failed on purpose")
        return [5, 6]

    engine = RolloutEngine(model, GenerationConfig(do_sample=False, max_new_tokens=long_turn, pad_token_id=0),
                           num_slots=2, eos_token_ids=[96], max_completion_length=long_turn,
                           max_tool_calling_iterations=1, parse_turn=lambda ids, prefix, schemas: {
                               "role": "assistant", "tool_calls": [{"type": "function", "function": {
                                   "name": "noop", "arguments": {}}}]},
                           tool_suffix_ids=suffix, logits_processor=processors, lockstep_group=dist.group.WORLD)
    if rank == 1:
        engine.per_turn = 2  # rank 1's first turn ends after 2 tokens (then its tool round)
    prompt = [7, 8, 9] if not (case == "bad_prompt" and rank == 1) else [7, 10_000]
    tools = {"noop": lambda: "ok"} if case == "tool" else None
    start = time.monotonic()
    try:
        engine.run([EpisodeSpec(prompt, tools=tools), EpisodeSpec([11, 12], tools=tools)])
        raised = None
    except Exception as err:  # noqa: BLE001  what the rank raised is the result
        raised = f"{type(err).__name__}: {err}"
    return {"raised": raised, "steps": engine.stats["steps"] + engine.stats["idle_steps"],
            "seconds": time.monotonic() - start}


def _rank_main(out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = KDAMoEForCausalLM(tiny_config(max_position_embeddings=256)).eval()
    results = {case: _case(case, rank, model) for case in CASES}
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.mark.xdist_group("distributed")
def test_a_failing_rank_makes_every_rank_raise_within_one_step(tmp_path):
    launch_processes([str(Path(__file__)), str(tmp_path)], 2, DEADLINE_S)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    own = {"bad_prompt": "ValueError: episode 0: prompt_ids: token id 10000 is not an integer in",
           "tool": "RuntimeError: tool_suffix_ids failed on purpose",
           "sampling": "RuntimeError: processor failed on purpose"}
    for case in CASES:
        zero, one = ranks[0][case], ranks[1][case]
        assert zero["raised"] is not None and "rank 1 of lockstep_group failed" in zero["raised"], (case, zero)
        assert one["raised"] is not None and one["raised"].startswith(own[case]), (case, one)
        assert zero["steps"] <= one["steps"] + 1, (case, zero, one)  # within one step of rank 1's last
        assert zero["seconds"] < PG_TIMEOUT_S / 2, (case, zero)  # nobody waited for the process-group timeout
    assert ranks[1]["tool"]["steps"] >= 2 and ranks[1]["sampling"]["steps"] >= 2  # they failed mid-run


if __name__ == "__main__":
    _rank_main(*sys.argv[1:])
