"""The key-hunt environment and its data: the reward rule restated independently and checked through the tools,
task generation against a brute-force count, the chat template's rendering of the key-hunt tools and episodes
(TRL's tool-calling and prefix checks), the SFT demonstrations, and GRPO mode ``environment`` on key hunts through
TRL's real tool loop with a scripted policy (the model's ``generate`` replaced by a careful / hasty agent that
reads the rendered conversation).
"""

import json
import re

import pytest
import torch
from transformers import AutoTokenizer
from trl.chat_template_utils import is_chat_template_prefix_preserving, supports_tool_calling

from kdamoe import KDAMoEForCausalLM
from kdamoe.posttraining import load_posttrain_config
from kdamoe.posttraining.data import sft_dataset
from kdamoe.posttraining.environments import make_family_tasks, tool_schemas
from kdamoe.posttraining.environments.keyhunt import PLACES, ROOMS, KeyHuntEnvironment, KeyHuntTask, make_keyhunt_tasks
from kdamoe.posttraining.recipes import build_trainer
from kdamoe.training.tokenizer import train_tokenizer
from tests.helpers import tiny_config
from tests.test_posttrain import record_rewards


def expected_reward(n_rooms: int, opened: int | None) -> float:
    """The key-hunt rule (keyhunt module docstring) restated: ``opened`` doors before ``take_key`` (``None``: the
    key was never taken). 1.0 when at least ``n_rooms`` doors were opened first (the task solved), else 0.0: no
    partial credit for a key taken too early."""
    if opened is None:
        return 0.0
    return 1.0 if opened >= n_rooms else 0.0


def _play(env, task, opened, take=True):
    env.reset(task=task.to_json())
    results = [env.open_door() for _ in range(opened)]
    if take:
        results.append(env.take_key())
    return results


def _keyhunt_tokenizer():
    tasks = make_keyhunt_tasks(40, seed=5, max_rooms=3)
    tools = tool_schemas(KeyHuntEnvironment)
    rows = sft_dataset(tasks, hasty_fraction=0.5, seed=0)
    probe = train_tokenizer(["x"], vocab_size=300, min_frequency=1)  # only its chat template renders the texts
    texts = [probe.apply_chat_template(r["messages"], tools=tools, tokenize=False) for r in rows]
    return train_tokenizer(texts, vocab_size=300, min_frequency=1)


@pytest.fixture(scope="module")
def tokenizer():
    return _keyhunt_tokenizer()


# ------------------------------------------------------------------------------------------- the reward rule


def test_careful_agent_gets_the_key_and_full_reward():
    task = KeyHuntTask("castle", ("hall", "attic", "vault"))
    env = KeyHuntEnvironment()
    results = _play(env, task, 3)
    assert results == ["A hall. Another door leads on.", "An attic. Another door leads on.",
                       "A vault. The key lies here!", "you have the key"]
    assert env.get_reward() == expected_reward(3, 3) == 1.0
    assert env.tool_calls_before_submit == 3 and env.done


@pytest.mark.parametrize("n_rooms", [1, 2, 4])
def test_hasty_agent_at_every_early_stop(n_rooms):
    task = KeyHuntTask("inn", tuple(ROOMS[:n_rooms]))
    env = KeyHuntEnvironment()
    for opened in range(n_rooms):
        results = _play(env, task, opened)
        assert results[-1] == "there is no key here", opened
        assert all("Another door leads on." in r for r in results[:-1]), opened
        assert env.get_reward() == pytest.approx(expected_reward(n_rooms, opened)), opened
        assert env.get_reward() == 0.0 and env.tool_calls_before_submit == opened


def test_never_taking_the_key_earns_nothing():
    task = KeyHuntTask("tower", ("cellar", "study"))
    env = KeyHuntEnvironment()
    assert env.get_reward() == 0.0  # before any reset
    for opened in range(4):  # short of the key, at the key, past it
        _play(env, task, opened, take=False)
        assert env.get_reward() == expected_reward(2, None) == 0.0, opened
        assert not env.done


def test_extra_doors_after_the_key():
    task = KeyHuntTask("fort", ("kitchen",))
    env = KeyHuntEnvironment()
    results = _play(env, task, 3)
    assert results == ["A kitchen. The key lies here!", "no more doors", "no more doors", "you have the key"]
    assert env.get_reward() == expected_reward(1, 3) == 1.0
    assert env.tool_calls_before_submit == 3 and env.entered == 1
    assert env.calls == [("open_door", {})] * 3 + [("take_key", {})]


def test_calls_after_take_key_and_bad_resets_are_refused():
    env = KeyHuntEnvironment()
    with pytest.raises(ValueError, match="reset"):
        env.open_door()  # no episode yet
    task = KeyHuntTask("palace", ("hall", "vault"))
    _play(env, task, 1)
    for tool in (env.open_door, env.take_key):
        with pytest.raises(ValueError, match="already taken"):
            tool()
    assert env.get_reward() == 0.0 and env.entered == 1 and len(env.calls) == 2  # refused calls change nothing
    with pytest.raises(ValueError, match="task"):
        env.reset()
    for bad in ("not json", '{"place": "castle"}', '["castle", ["hall"]]', "null",
                '{"place": "moon base", "rooms": ["hall"]}', '{"place": "castle", "rooms": []}',
                '{"place": "castle", "rooms": ["hall", "garage"]}', '{"place": "castle", "rooms": "hall"}'):
        with pytest.raises(ValueError):
            env.reset(task=bad)
    env.reset(task=task)  # a KeyHuntTask is accepted as is, and the new episode starts clean
    assert (env.entered, env.done, env.calls, env.get_reward()) == (0, False, [], 0.0)


# ------------------------------------------------------------------------------------------ task generation


def _possible(min_rooms, max_rooms):
    """Brute-force count of the distinct tasks: every place times every sequence of rooms."""
    count = 0
    for k in range(min_rooms, max_rooms + 1):
        sequences = [()]
        for _ in range(k):
            sequences = [s + (r,) for s in sequences for r in ROOMS]
        count += len(PLACES) * len(sequences)
    return count


def test_make_keyhunt_tasks_distinct_seeded_and_excluding():
    tasks = make_keyhunt_tasks(60, seed=3, min_rooms=2, max_rooms=4)
    assert len(set(tasks)) == 60
    assert all(2 <= t.calls_needed <= 4 and t.place in PLACES and set(t.rooms) <= set(ROOMS) for t in tasks)
    assert {t.calls_needed for t in tasks} == {2, 3, 4}
    assert make_keyhunt_tasks(60, seed=3, min_rooms=2, max_rooms=4) == tasks
    assert make_keyhunt_tasks(60, seed=4, min_rooms=2, max_rooms=4) != tasks
    held_out = make_keyhunt_tasks(60, seed=3, min_rooms=2, max_rooms=4, exclude=set(tasks))
    assert not set(held_out) & set(tasks) and len(set(held_out)) == 60
    for task in tasks:
        assert KeyHuntTask.from_json(task.to_json()) == task


def test_make_keyhunt_tasks_all_possible_then_refuses_one_more():
    n = _possible(1, 1)
    assert n == 144
    every = {KeyHuntTask(p, (r,)) for p in PLACES for r in ROOMS}
    assert set(make_keyhunt_tasks(n, seed=0, min_rooms=1, max_rooms=1)) == every
    with pytest.raises(ValueError, match=str(n + 1)):
        make_keyhunt_tasks(n + 1, seed=0, min_rooms=1, max_rooms=1)
    exclude = set(make_keyhunt_tasks(10, seed=1, min_rooms=1, max_rooms=1))
    assert set(make_keyhunt_tasks(n - 10, seed=0, min_rooms=1, max_rooms=1, exclude=exclude)) == every - exclude
    with pytest.raises(ValueError, match=str(n - 9)):
        make_keyhunt_tasks(n - 9, seed=0, min_rooms=1, max_rooms=1, exclude=exclude)
    assert make_keyhunt_tasks(0, seed=0) == []


@pytest.mark.parametrize("environment", ["keyhunt", "arithmetic"])
def test_excluded_tasks_outside_the_range_do_not_count(environment):
    """Tasks of other call counts in ``exclude`` (a training set with 1-3 calls next to a held-out set of 2-3,
    as the demo has) cannot be drawn anyway: every task of the range is still available. (Before the fix the
    generators subtracted all of ``exclude`` from the count of possible tasks and refused.)"""
    kwargs = dict(min_calls=1, max_calls=1, max_operand=3)
    every = 144 if environment == "keyhunt" else 2 * 2 * 2  # starts x operations x operands in [2, 3]
    other = set(make_family_tasks(environment, 20, seed=2, min_calls=2, max_calls=3, max_operand=3))
    got = make_family_tasks(environment, every, seed=0, exclude=other, **kwargs)
    assert len(set(got)) == every and all(t.calls_needed == 1 for t in got)


def test_possible_count_matches_brute_force():
    n = _possible(1, 2)
    assert len(set(make_keyhunt_tasks(n, seed=7, min_rooms=1, max_rooms=2))) == n
    with pytest.raises(ValueError, match=str(n + 1)):
        make_keyhunt_tasks(n + 1, seed=7, min_rooms=1, max_rooms=2)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(min_rooms=0), "min_rooms=0"), (dict(min_rooms=3, max_rooms=2), "min_rooms=3"),
    (dict(max_rooms=9), "max_rooms=9"), (dict(n=-1), "-1"),
])
def test_make_keyhunt_tasks_refuses_bad_ranges(kwargs, needle):
    kwargs = {"n": 4, "seed": 0, **kwargs}
    with pytest.raises(ValueError, match=needle):
        make_keyhunt_tasks(kwargs.pop("n"), kwargs.pop("seed"), **kwargs)


# ----------------------------------------------------------------------------- chat template and SFT data


def test_template_renders_key_hunt_tools_and_episode(tokenizer):
    assert supports_tool_calling(tokenizer) and is_chat_template_prefix_preserving(tokenizer)
    task = KeyHuntTask("abbey", ("hall", "armoury"))
    messages = sft_dataset([task], hasty_fraction=0.0)[0]["messages"]
    tools = tool_schemas(KeyHuntEnvironment)
    full = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert "\nopen_door() -> string: Open the next door and walk through it." in full
    assert "\ntake_key() -> string: Take the key from the room you are in. This ends the task." in full
    assert "Find the key hidden in the abbey.<|im_end|>" in full
    assert full.count('<tool_call>\n{"name": "open_door", "arguments": {}}\n</tool_call>') == 2
    assert full.count('{"name": "take_key", "arguments": {}}') == 1
    assert re.findall(r"<tool_response>\n(.*?)\n</tool_response>", full) == [
        "A hall. Another door leads on.", "An armoury. The key lies here!", "you have the key"]
    assert full.endswith("<|im_start|>assistant\nDone.<|im_end|>\n")
    full_ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False)
    for k in range(1, len(messages)):
        head = tokenizer.apply_chat_template(messages[:k], tools=tools, tokenize=False)
        assert full.startswith(head), k
        head_ids = tokenizer.apply_chat_template(messages[:k], tools=tools, tokenize=True, return_dict=False)
        assert full_ids[: len(head_ids)] == head_ids, k


def _opens_and_take(messages):
    """(number of open_door calls, take_key's tool result, tool results) of an SFT conversation."""
    names = [c["function"]["name"] for m in messages if m["role"] == "assistant"
             for c in m.get("tool_calls") or []]
    results = [m["content"] for m in messages if m["role"] == "tool"]
    assert names[-1] == "take_key" and "take_key" not in names[:-1]
    return names.count("open_door"), results[-1], results


def test_sft_dataset_careful_and_hasty(tokenizer):
    tasks = make_keyhunt_tasks(24, seed=11, min_rooms=1, max_rooms=3)
    careful = sft_dataset(tasks, hasty_fraction=0.0, seed=0)
    hasty = sft_dataset(tasks, hasty_fraction=1.0, seed=0)
    assert sft_dataset(tasks, hasty_fraction=1.0, seed=0)[:] == hasty[:]
    stops = set()
    for task, c, h in zip(tasks, careful, hasty, strict=True):
        first, last = c["messages"][0], c["messages"][-1]
        assert (first["role"], first["content"]) == ("user", f"Find the key hidden in the {task.place}.")
        assert (last["role"], last["content"], last["tool_calls"]) == ("assistant", "Done.", None)
        assert json.loads(c["tools"]) == tool_schemas(KeyHuntEnvironment)
        opened, taken, results = _opens_and_take(c["messages"])
        assert opened == task.calls_needed and taken == "you have the key"
        assert [r.split(". ")[0].split(" ", 1)[1] for r in results[:-1]] == list(task.rooms)
        assert expected_reward(task.calls_needed, opened) == 1.0
        opened, taken, results = _opens_and_take(h["messages"])
        assert opened < task.calls_needed and taken == "there is no key here"
        assert all(r.endswith("Another door leads on.") for r in results[:-1])
        stops.add(opened)
    assert stops == {0, 1, 2}  # the hasty agent stops at random points, none of them at the key


# --------------------------------------------------------- GRPO (environment) through TRL's real tool loop


FAST = ["trainer.max_steps=1", "trainer.warmup_steps=0", "trainer.per_device_train_batch_size=4",
        "trainer.save_strategy='no'", "trainer.num_generations=2", "data.environment=keyhunt", "data.num_tasks=6",
        "data.min_calls=1", "data.max_calls=3"]
_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.S)
_PLACE = re.compile(r"Find the key hidden in the (.+?)\.<\|im_end\|>")


def hasty_stop(place):
    """The scripted policy's plan per prompt (the place is all the prompt tells): ``None`` = careful (open until
    a tool result says the key is there), else open at most this many doors, then take the key."""
    return (None, 0, 1)[PLACES.index(place) % 3]


def scripted_reply(text):
    """The next assistant message of the scripted agent, read from the rendered conversation so far."""
    place = _PLACE.search(text).group(1)
    results = _RESPONSE.findall(text)
    if results and results[-1] in ("you have the key", "there is no key here"):
        return {"role": "assistant", "content": "Done."}
    stop = hasty_stop(place)
    found = bool(results) and results[-1].endswith("The key lies here!")
    name = "take_key" if found or (stop is not None and len(results) >= stop) else "open_door"
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {}}}]}


def _reply_ids(tokenizer, message):
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "x"}, message], tokenize=False)
    reply = rendered.rsplit("<|im_start|>assistant\n", 1)[1].rstrip("\n")
    return tokenizer(reply, add_special_tokens=False)["input_ids"]


def script_generate(model, tokenizer):
    def generate(input_ids, attention_mask=None, **kwargs):
        rows = []
        for ids, mask in zip(input_ids, attention_mask, strict=True):
            text = tokenizer.decode(ids[mask.bool()], skip_special_tokens=False)
            rows.append(torch.tensor(_reply_ids(tokenizer, scripted_reply(text))))
        new = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=tokenizer.pad_token_id)
        return torch.cat([input_ids, new.to(input_ids)], dim=1)

    model.generate = generate


@pytest.fixture(scope="module")
def base(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("keyhunt_base")
    torch.manual_seed(0)
    config = tiny_config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         max_position_embeddings=1024, kda_head_dim=16)
    KDAMoEForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_grpo_environment_on_key_hunts_gives_the_restated_rewards(base, tmp_path):
    cfg = load_posttrain_config("grpo", [f"model={base}", f"output_dir={tmp_path / 'grpo'}", *FAST])
    assert cfg.grpo.mode == "environment"
    model = KDAMoEForCausalLM.from_pretrained(base, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(base)
    trainer = build_trainer(cfg, model, tokenizer)
    script_generate(model, tokenizer)
    seen = record_rewards(trainer)
    trainer.train()
    assert len(seen) == 4  # one batch: 2 prompts x 2 generations
    plans = set()
    for task_json, reward in seen:
        data = json.loads(task_json)
        n, stop = len(data["rooms"]), hasty_stop(data["place"])
        opened = n if stop is None else min(stop, n)
        plans.add("careful" if opened == n else "hasty")
        assert reward == pytest.approx(expected_reward(n, opened)), data
    assert plans == {"careful", "hasty"}  # the fixed seed's batch holds both kinds of episode
    row = trainer.state.log_history[0]
    assert row["tools/call_frequency"] > 0 and row["tools/failure_frequency"] == 0
