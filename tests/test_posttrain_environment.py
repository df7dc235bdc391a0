"""The arithmetic environment and the generated post-training data: rewards from the environment's state, answers
against a brute-force fold, held-out tasks disjoint from training, and the chat template's rendering of the data
(TRL's tool-calling and prefix checks, JSON-text arguments equal to ``tojson``)."""

import itertools
import json
import operator

import pytest
from trl.chat_template_utils import (
    has_generation_markers,
    is_chat_template_prefix_preserving,
    is_chat_template_stop_token_trained,
    supports_tool_calling,
)

from kdamoe.posttraining.data import episode_messages, preference_dataset, prompt_dataset, sft_dataset
from kdamoe.posttraining.environments import tool_schemas
from kdamoe.posttraining.environments.arithmetic import OPERATIONS, ArithmeticEnvironment, ArithmeticTask, make_tasks
from kdamoe.training.tokenizer import train_tokenizer

FOLD = {"add": operator.add, "multiply": operator.mul}


@pytest.fixture(scope="module")
def tokenizer():
    texts = [t.prompt() for t in make_tasks(30, seed=1)] + ['{"name": "add", "arguments": {"a": 1}}']
    return train_tokenizer(texts, vocab_size=300, min_frequency=1)


def _run(env, task, calls):
    env.reset(task=task.to_json())
    for name, args in calls:
        getattr(env, name)(**args)
    return env.get_reward()


def test_answers_match_a_brute_force_fold():
    for task in make_tasks(50, seed=3, max_ops=4):
        value = task.start
        for name, operand in task.ops:
            value = FOLD[name](value, operand)
        assert task.answer == value


def test_reward_comes_from_the_environment_state():
    task = ArithmeticTask(3, (("add", 4), ("multiply", 5)))  # 3 + 4 = 7, 7 * 5 = 35
    env = ArithmeticEnvironment()
    careful = [("add", {"a": 3, "b": 4}), ("multiply", {"a": 7, "b": 5}), ("submit", {"answer": 35})]
    assert _run(env, task, careful) == 1.0 and env.tool_calls_before_submit == 2
    assert _run(env, task, careful[:1] + [("submit", {"answer": 7})]) == 0.25  # 1 of 2 steps, wrong answer
    assert _run(env, task, [("submit", {"answer": 35})]) == 0.0  # the right value without the tools: no credit
    assert _run(env, task, [("submit", {"answer": 34})]) == 0.0
    assert _run(env, task, [("multiply", {"a": 3, "b": 4}), ("submit", {"answer": 12})]) == 0.0  # wrong tool
    assert _run(env, task, [("add", {"a": "4", "b": "3"}), ("submit", {"answer": 1})]) == 0.25  # operands any order
    env.reset(task=task.to_json())
    assert env.get_reward() == 0.0  # a fresh episode: no submitted value, no steps
    env.submit(answer=35)
    with pytest.raises(ValueError, match="already submitted"):
        env.add(a=1, b=2)
    with pytest.raises(ValueError, match="task"):
        env.reset()


def test_tools_refuse_non_integers():
    env = ArithmeticEnvironment()
    env.reset(task=ArithmeticTask(2, (("add", 2),)))
    assert env.add(a=2.0, b="3") == 5
    with pytest.raises(ValueError, match="1.5"):
        env.add(a=1.5, b=2)


def test_make_tasks_counts_and_held_out_is_disjoint():
    every = {ArithmeticTask(s, tuple(ops)) for s in range(2, 4) for k in (1, 2)
             for ops in itertools.product(itertools.product(OPERATIONS, range(2, 4)), repeat=k)}
    assert set(make_tasks(len(every), seed=0, min_ops=1, max_ops=2, max_operand=3)) == every
    with pytest.raises(ValueError, match=str(len(every) + 1)):
        make_tasks(len(every) + 1, seed=0, max_ops=2, max_operand=3)
    train = make_tasks(40, seed=0)
    held_out = make_tasks(40, seed=0, exclude=set(train))
    assert not set(train) & set(held_out) and len(set(held_out)) == 40
    assert make_tasks(40, seed=0) == train  # a seed fixes the tasks
    for task in train:
        assert ArithmeticTask.from_json(task.to_json()) == task


def test_tokenizer_passes_trl_template_checks(tokenizer):
    assert supports_tool_calling(tokenizer)
    assert is_chat_template_prefix_preserving(tokenizer)
    assert has_generation_markers(tokenizer.chat_template)
    assert is_chat_template_stop_token_trained(tokenizer)


def test_episode_renders_prefix_by_prefix(tokenizer):
    task = ArithmeticTask(3, (("add", 4), ("multiply", 5)))
    messages = sft_dataset([task])[0]["messages"]
    tools = tool_schemas(ArithmeticEnvironment)
    full = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    for n in range(1, len(messages)):
        assert full.startswith(tokenizer.apply_chat_template(messages[:n], tools=tools, tokenize=False))
    assert full.count("<tool_call>\n") == 3 and full.count("<tool_response>") == 3
    assert "\nadd(a: integer, b: integer) -> integer: Add two integers." in full


def test_json_text_arguments_render_as_tojson(tokenizer):
    task = ArithmeticTask(3, (("add", 4),))
    as_text = episode_messages(task)
    as_dict = json.loads(json.dumps(as_text))
    for message in as_dict:
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])

    def render(m):
        return tokenizer.apply_chat_template([{"role": "user", "content": "x"}, *m], tokenize=False)

    assert render(as_text) == render(as_dict)
    assert '{"name": "add", "arguments": {"a": 3, "b": 4}}' in render(as_text)


def test_dataset_columns():
    tasks = make_tasks(6, seed=2)
    rows = prompt_dataset(tasks)
    assert [r["answer"] for r in rows] == [t.answer for t in tasks]
    assert [ArithmeticTask.from_json(r["task"]) for r in rows] == tasks
    pairs = preference_dataset(tasks, seed=0)
    for pair, task in zip(pairs, tasks, strict=True):
        chosen_submit = json.loads(pair["chosen"][-3]["tool_calls"][0]["function"]["arguments"])["answer"]
        rejected_submit = json.loads(pair["rejected"][-3]["tool_calls"][0]["function"]["arguments"])["answer"]
        assert chosen_submit == task.answer and rejected_submit != task.answer
    hasty = sft_dataset(tasks, hasty_fraction=1.0, seed=0)
    assert all(len(r["messages"]) < 1 + len(episode_messages(t)) for r, t in zip(hasty, tasks, strict=True))
    with pytest.raises(ValueError, match="1.5"):
        sft_dataset(tasks, hasty_fraction=1.5)
