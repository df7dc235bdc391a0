"""The held-out agent loop (:func:`kdamoe.posttraining.agent.run_episodes`), its metrics, and the post-training demo.

The loop is driven by a *scripted* ``model.generate``: each row's reply depends only on the place named in its
prompt and on the tool results it has seen, so every episode's course is known in advance. The expected
conversation of each episode is written out by hand here and rendered with the chat template; the loop — which
concatenates token ids (prompt + generated + tool suffix) and never re-tokenises — must have fed the model
exactly that re-render at every turn.
"""

import copy
import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from kdamoe import KDAMoEForCausalLM
from kdamoe.cli import posttrain_demo_main
from kdamoe.posttraining.agent import run_episodes, summarize_episodes
from kdamoe.posttraining.demo import STAGES, paired_lower_bound
from kdamoe.posttraining.environments.keyhunt import KeyHuntEnvironment, KeyHuntTask
from tests.helpers import tiny_config
from tests.test_posttrain_keyhunt import _keyhunt_tokenizer, _reply_ids, expected_reward

_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.S)
_PLACE = re.compile(r"Find the key hidden in the (.+?)\.<\|im_end\|>")
_TAKEN = ("you have the key", "there is no key here")


def _bad_arguments_error() -> str:
    """What ``open_door(door=2)`` raises, read off Python itself (the model is to see it as the tool's error)."""
    try:
        KeyHuntEnvironment().open_door(door=2)
    except TypeError as err:
        return str(err)
    raise AssertionError("open_door accepted an argument")


# behaviour of the scripted agent per place; each entry: (task, plan)
#   "careful": open until a result says the key is there, then take it; ("hasty", k): open at most k doors, take;
#   "never": open until the key is there, then stop talking; "wander": open doors forever;
#   "errors": first an unknown tool, then open_door with an argument, then careful.
EPISODES = {
    "castle": (KeyHuntTask("castle", ("hall", "vault")), "careful"),
    "tower": (KeyHuntTask("tower", ("cellar", "study", "attic")), ("hasty", 1)),
    "manor": (KeyHuntTask("manor", ("kitchen", "pantry")), "never"),
    "abbey": (KeyHuntTask("abbey", ("gallery",)), "wander"),
    "palace": (KeyHuntTask("palace", ("hall", "cellar", "kitchen", "study", "gallery", "pantry", "stable", "attic")),
               "wander"),
    "inn": (KeyHuntTask("inn", ("armoury",)), "errors"),
}


def _call(name, **arguments):
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]}


def plan_reply(plan, results):
    """The scripted agent's next assistant message given the tool results so far."""
    if results and results[-1] in _TAKEN:
        return {"role": "assistant", "content": "Done."}
    found = bool(results) and results[-1].endswith("The key lies here!")
    if plan == "errors" and len(results) < 2:
        return _call("open_window") if not results else _call("open_door", door=2)
    if plan in ("careful", "errors"):
        return _call("take_key" if found else "open_door")
    if plan == "never":
        return {"role": "assistant", "content": "I am done looking."} if found else _call("open_door")
    if plan == "wander":
        return _call("open_door")
    return _call("take_key" if found or len(results) >= plan[1] else "open_door")


def expected_conversation(task, plan, max_turns):
    """(messages, ended) of the episode, played on a fresh environment by hand: the loop's own rules
    (stop after the final tool, after a turn without a tool call, or after ``max_turns`` turns)."""
    env = KeyHuntEnvironment()
    env.reset(task=task)
    messages, results = [{"role": "user", "content": task.prompt()}], []
    for _ in range(max_turns):
        reply = plan_reply(plan, results)
        messages.append(reply)
        if not reply.get("tool_calls"):
            return messages, "no_tool_call"
        name = reply["tool_calls"][0]["function"]["name"]
        if name == "open_window":
            content = str({"error": "Tool open_window not found."})  # TRL's message for an unknown tool
        elif reply["tool_calls"][0]["function"]["arguments"]:
            content = str({"error": _bad_arguments_error()})
        else:
            content = getattr(env, name)()
        if name == "take_key":
            return messages, "done"
        results.append(content)
        messages.append({"role": "tool", "name": name, "content": content})
    return messages, "turns"


class ScriptedGenerate:
    """``model.generate`` of the scripted agent; records each row's unpadded input ids and the call's kwargs."""

    def __init__(self, tokenizer):
        self.tokenizer, self.inputs, self.kwargs = tokenizer, {}, []

    def __call__(self, input_ids, attention_mask, max_new_tokens, **kwargs):
        self.kwargs.append(kwargs)
        rows = []
        for ids, mask in zip(input_ids, attention_mask, strict=True):
            n = int(mask.sum())
            assert mask[-n:].all() and not mask[:-n].any()  # left padding
            text = self.tokenizer.decode(ids[-n:], skip_special_tokens=False)
            place = _PLACE.search(text).group(1)
            self.inputs.setdefault(place, []).append(ids[-n:].tolist())
            reply = plan_reply(EPISODES[place][1], _RESPONSE.findall(text))
            rows.append(torch.tensor(_reply_ids(self.tokenizer, reply)[:max_new_tokens]))
        new = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=self.tokenizer.pad_token_id)
        return torch.cat([input_ids, new.to(input_ids)], dim=1)


@pytest.fixture(scope="module")
def tokenizer():
    return _keyhunt_tokenizer()


@pytest.fixture()
def model(tokenizer):
    torch.manual_seed(0)
    model = KDAMoEForCausalLM(tiny_config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                          bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                          max_position_embeddings=1024))
    model.generate = ScriptedGenerate(tokenizer)
    return model


def _render(tokenizer, messages, generation_prompt):
    tools = [KeyHuntEnvironment().open_door, KeyHuntEnvironment().take_key]  # transformers renders their schemas
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False,
                                         add_generation_prompt=generation_prompt)


def _cut_after_last_eos(tokenizer, ids):
    last = max(i for i, t in enumerate(ids) if t == tokenizer.eos_token_id)
    return ids[: last + 1]


def test_run_episodes_matches_the_scripted_episodes(model, tokenizer):
    max_new_tokens = 48
    expected, prefixes = {}, {}
    for place, (task, plan) in EPISODES.items():
        messages, ended = expected_conversation(task, plan, task.calls_needed + 2)
        expected[place] = (messages, ended)
        # the model's input before each turn: everything up to that assistant turn, with the generation prompt
        prefixes[place] = [_render(tokenizer, messages[:i], True) for i, m in enumerate(messages)
                           if m["role"] == "assistant"]
    # the 8-room wanderer runs out of context before its 5th turn; everyone else's inputs stay far below
    limit = len(prefixes["palace"][4]) + max_new_tokens - 1
    assert max(len(p) for place, ps in prefixes.items() if place != "palace" for p in ps) + max_new_tokens <= limit
    model.config.max_position_embeddings = limit
    expected["palace"] = (None, "context")
    prefixes["palace"] = prefixes["palace"][:4]

    tasks = [task for task, _ in EPISODES.values()]
    episodes = run_episodes(model, tokenizer, tasks, batch_size=4, max_new_tokens=max_new_tokens)

    assert [e["task"] for e in episodes] == tasks
    assert {e["task"].place: e["ended"] for e in episodes} == {p: ended for p, (_, ended) in expected.items()}
    want = {  # (reward, open_door calls, tool calls the environment ran, turns)
        "castle": (expected_reward(2, 2), 2, 3, 3), "tower": (expected_reward(3, 1), 1, 2, 2),
        "manor": (expected_reward(2, None), 2, 2, 3), "abbey": (expected_reward(1, None), 3, 3, 3),
        "palace": (expected_reward(8, None), 4, 4, 4),
        "inn": (expected_reward(1, None), 1, 1, 3),  # two turns lost to errors: out of turns before take_key
    }
    for e in episodes:
        place = e["task"].place
        assert (e["reward"], e["calls_before_submit"], e["tool_calls"], e["turns"]) == pytest.approx(want[place]), place
        assert model.generate.inputs[place] == prefixes[place], place  # concatenated ids == re-render, every turn
        assert e["prompt_tokens"] == len(prefixes[place][0])
        messages, ended = expected[place]
        if ended in ("done", "no_tool_call"):  # the sequence stops at the last turn's end-of-turn token
            final = _cut_after_last_eos(tokenizer, _render(tokenizer, messages, False))
        elif ended == "turns":  # the last tool result was appended, with the next assistant header
            final = _render(tokenizer, messages, True)
        else:
            final = _render(tokenizer, expected_conversation(*EPISODES[place], 4)[0], True)
        assert e["tokens"] == len(final), place
    assert all(k["do_sample"] is False and k["eos_token_id"] == tokenizer.eos_token_id for k in model.generate.kwargs)
    assert model.training  # put back in train mode


def test_tool_errors_reach_the_model_and_the_loop_goes_on(model, tokenizer):
    task, _ = EPISODES["inn"]
    (episode,) = run_episodes(model, tokenizer, [task], max_turns=6)
    inputs = model.generate.inputs["inn"]
    seen = [_RESPONSE.findall(tokenizer.decode(ids)) for ids in inputs]
    assert seen[1] == ["{'error': 'Tool open_window not found.'}"]
    assert seen[2][1] == str({"error": _bad_arguments_error()}) and "door" in seen[2][1]
    assert seen[3][2] == "An armoury. The key lies here!"
    assert (episode["ended"], episode["reward"], episode["turns"]) == ("done", 1.0, 4)


def test_sampling_passes_temperature_and_is_seeded(model, tokenizer):
    tasks = [EPISODES["castle"][0], EPISODES["tower"][0]]
    episodes = run_episodes(model, tokenizer, tasks, do_sample=True, temperature=0.7, seed=3)
    assert [e["reward"] for e in episodes] == [1.0, pytest.approx(expected_reward(3, 1))]
    assert all(k["do_sample"] is True and k["temperature"] == 0.7 for k in model.generate.kwargs)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(batch_size=0), "batch_size"), (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(do_sample=True, temperature=0.0), "temperature must be > 0"),
])
def test_run_episodes_refuses_bad_arguments(model, tokenizer, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        run_episodes(model, tokenizer, [EPISODES["castle"][0]], **kwargs)
    assert model.generate.kwargs == []


def test_run_episodes_needs_a_response_template(model, tokenizer):
    plain = copy.deepcopy(tokenizer)
    plain.response_template = None
    with pytest.raises(ValueError, match="response_template"):
        run_episodes(model, plain, [EPISODES["castle"][0]])


def test_summarize_episodes_by_hand():
    rooms = ("hall", "cellar", "study")
    rows = [(1, 1.0, 1), (2, 1.0, 2), (2, 0.25, 1), (3, 0.0, 3), (3, 1 / 3, 2)]  # (rooms, reward, calls)
    episodes = [dict(task=KeyHuntTask("fort", rooms[:n]), reward=r, calls_before_submit=c) for n, r, c in rows]
    got = summarize_episodes(episodes)  # min_calls=2: the last four
    assert got == pytest.approx(dict(n=4, success=1 / 4, mean_reward=(1.0 + 0.25 + 0.0 + 1 / 3) / 4,
                                     multi_call_share=3 / 4, n_all=5, success_all=2 / 5,
                                     mean_reward_all=(1.0 + 1.0 + 0.25 + 0.0 + 1 / 3) / 5))
    got = summarize_episodes(episodes, min_calls=3)
    assert (got["n"], got["success"], got["multi_call_share"]) == (2, 0.0, 1.0)
    assert got["mean_reward"] == pytest.approx(1 / 6)
    with pytest.raises(ValueError, match=">= 4"):
        summarize_episodes(episodes, min_calls=4)


# ---------------------------------------------------------------------------------------------------- demo


@pytest.mark.parametrize("argv, needle", [
    (["--seeds", "0"], "--seeds must be >= 1 (got 0)"), (["--held-out", "0"], "--held-out must be >= 1 (got 0)"),
])
def test_demo_cli_usage_errors(argv, needle, capsys):
    with pytest.raises(SystemExit) as exit_info:
        posttrain_demo_main(argv)
    assert exit_info.value.code == 2
    assert needle in capsys.readouterr().err


def test_demo_cli_refuses_a_base_without_config(tmp_path, capsys):
    empty = tmp_path / "not_a_model"
    empty.mkdir()
    with pytest.raises(SystemExit) as exit_info:
        posttrain_demo_main(["--base", str(empty), "--output-dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert str(empty) in err and "config.json" in err
    assert not (tmp_path / "out").exists()


DEMO_FAST = ["trainer.max_steps=1", "trainer.warmup_steps=0", "trainer.per_device_train_batch_size=2",
             "trainer.save_strategy='no'", "data.num_tasks=8"]


def test_paired_lower_bound_restated():
    better, worse = [1, 1, 1, 0, 1, 0], [0, 1, 0, 0, 1, 1]  # differences 1, 0, 1, 0, 0, -1
    got = paired_lower_bound(better, worse)
    # by hand: mean 1/6; squared deviations (25+1+25+1+1+49)/36 = 102/36 over n-1 = 5 -> var 0.5667
    se = (102 / 36 / 5 / 6) ** 0.5
    assert got["n"] == 6 and got["difference"] == pytest.approx(1 / 6)
    assert got["std_error"] == pytest.approx(se) and got["lower"] == pytest.approx(1 / 6 - 1.6448536 * se)
    assert paired_lower_bound([1, 1], [0, 0])["lower"] == 1.0  # no spread: the bound is the difference
    with pytest.raises(ValueError, match="one length"):
        paired_lower_bound([1], [1, 0])


def test_run_demo_end_to_end(tokenizer, tmp_path, capsys):
    """Plumbing of the whole demo on a tiny random model (seconds): stages, control, curves, files, exit code,
    GRPO on the batched engine; not its verdict (a random model learns nothing in two steps)."""
    base = tmp_path / "base"
    torch.manual_seed(0)
    config = tiny_config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         max_position_embeddings=1024, kda_head_dim=16)
    KDAMoEForCausalLM(config).save_pretrained(base)
    tokenizer.save_pretrained(base)
    out = tmp_path / "demo"
    argv = ["--base", str(base), "--output-dir", str(out), "--held-out", "4"]
    argv += [f"--sft-set={o}" for o in DEMO_FAST]
    argv += [f"--grpo-set={o}" for o in DEMO_FAST + ["trainer.max_steps=2", "trainer.num_generations=2",
                                                       "trainer.max_completion_length=16"]]
    code = posttrain_demo_main(argv)
    written = json.loads((out / "results.json").read_text())
    assert code == (0 if written["verdict"] else 1)
    assert written["seeds"] == [0] and written["held_out"] == 4 and written["base"] == str(base) and written["complete"]
    (result,) = written["results"]
    assert result["seed"] == 0 and result["held_out"] == 4 and set(result["rows"]) == set(STAGES)
    for name, row in result["rows"].items():
        assert row["n"] == 4 and len(row["successes"]) == 4, name  # every held-out task needs >= 2 doors
        assert row["success"] == sum(row["successes"]) / 4, name
        for metric in ("success", "mean_reward", "multi_call_share"):
            assert 0.0 <= row[metric] <= 1.0, (name, metric)
    assert result["rows"]["grpo"]["steps"] == 2 and result["rows"]["sft"]["steps"] == 1
    assert result["rows"]["sft_more"]["steps"] >= 1
    for name, better, worse in (("grpo_vs_sft", "grpo", "sft"), ("grpo_vs_sft_more", "grpo", "sft_more")):
        diff = (sum(result["rows"][better]["successes"]) - sum(result["rows"][worse]["successes"])) / 4
        assert result["compare"][name]["difference"] == pytest.approx(diff), name
    assert result["verdict"] == all(c["lower"] >= 0.05 for c in result["compare"].values())
    # held-out curve: step 0 = the SFT model, step 1 = the callback's evaluation inside GRPO, step 2 = the final model
    assert [s for s, _ in result["heldout_curve"]] == [0, 1, 2]
    assert result["heldout_curve"][0][1] == result["rows"]["sft"]["success"]
    assert result["heldout_curve"][-1][1] == result["rows"]["grpo"]["success"]
    grpo_summary = json.loads((out / "seed0" / "grpo" / "summary.json").read_text())
    logged = [row for row in grpo_summary["log_history"] if "heldout/success" in row]
    assert [row["step"] for row in logged] == [1] and logged[0]["heldout/success"] == result["heldout_curve"][1][1]
    assert list((out / "seed0" / "grpo").rglob("events.out.tfevents.*"))  # TensorBoard got the run
    # GRPO's rollouts ran on the batched engine: its counters are logged as rollout/*, and each group of 2 episodes
    # forked from one prefill of its prompt (TRL's loop and the cached rollout log neither)
    assert grpo_summary["config"]["grpo"]["rollout"] == "batched"
    engine_rows = [row for row in grpo_summary["log_history"] if "rollout/steps" in row]
    assert engine_rows and all(row["rollout/forks"] >= 1 and row["rollout/steps"] >= 1 for row in engine_rows)
    for image in ("reward_curve.png", "heldout_curve.png"):
        assert (out / image).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", image
    printed = capsys.readouterr().out
    assert "grpo_vs_sft_more" in printed and "verdict" in printed
    for name in ("sft", "grpo", "sft_more"):
        final = result["rows"][name]["final"]
        assert final == str(out / "seed0" / name / "final")
        reloaded = AutoModelForCausalLM.from_pretrained(final, trust_remote_code=True)
        assert reloaded.config.model_type == "kda_moe" and reloaded.config.vocab_size == len(tokenizer)
