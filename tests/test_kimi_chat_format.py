"""Kimi's chat format in the recipes (:mod:`kdamoe.posttraining.chat_formats`) on the Kimi-style tokenizer of
:mod:`tests.kimi_tokenizer`: its special tokens, the format as the fixture template renders it (expected strings
written by hand from the format), TRL's tool-call parsing with Kimi's response template (round trips through the
chat template, several calls, malformed arguments), the format detection and its errors, and the marked training
template (same text as the folder's own, assistant mask on what the assistant writes).
"""

import copy
import json

import pytest
from trl.chat_template_utils import is_chat_template_prefix_preserving, parse_response

from kdamoe.posttraining.chat_formats import (
    KIMI_MARKERS,
    KIMI_RESPONSE_TEMPLATE,
    KIMI_TRAINING_CHAT_TEMPLATE,
    attach_response_template,
    chat_template_swapped,
    is_kimi_format,
    training_chat_template,
)
from kdamoe.posttraining.data import episode_messages, user_message
from kdamoe.posttraining.environments import ENVIRONMENTS, make_family_tasks, task_tool_schemas, tool_schemas
from kdamoe.posttraining.environments.arithmetic import ArithmeticEnvironment, make_tasks
from kdamoe.training.tokenizer import train_tokenizer
from tests.kimi_tokenizer import CHAT_TEMPLATE, SPECIAL, build_kimi_tokenizer, kimi_token_id

USER = {"role": "user", "content": "Start with 3, add 4."}
TOOLS = tool_schemas(ArithmeticEnvironment)


def _call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


@pytest.fixture(scope="module")
def tokenizer():
    texts = [t.prompt() for t in make_tasks(20, seed=3)] + ['{"a": 3, "b": 4} functions.add:0 ## Return of Done.']
    tok = build_kimi_tokenizer(texts, base_vocab_size=300)
    attach_response_template(tok, needs_tool_calls=True)
    return tok


def test_the_tokenizer_has_kimis_special_tokens_at_their_ids(tokenizer):
    n_base = len(tokenizer) - 256
    assert tokenizer.convert_ids_to_tokens([n_base, n_base + 1, n_base + 2, n_base + 4, n_base + 11, n_base + 255]) \
        == ["[BOS]", "[EOS]", "<|im_end|>", "<|im_assistant|>", "<|tool_calls_section_begin|>", "[PAD]"]
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("[BOS]", "[EOS]", "[PAD]")
    assert tokenizer.convert_ids_to_tokens(n_base + 5) == f"<|reserved_token_{n_base + 5}|>"
    # the tool-call markers are added but not special: a decode that skips special tokens keeps them
    ids = tokenizer("<|im_end|><|tool_call_begin|>x<|tool_call_end|>", add_special_tokens=False)["input_ids"]
    assert ids[0] == kimi_token_id(tokenizer, 2) and len(ids) == 4
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<|tool_call_begin|>x<|tool_call_end|>"
    assert tokenizer("hi")["input_ids"] == tokenizer("hi", add_special_tokens=False)["input_ids"]  # no bos added


def test_the_fixture_template_renders_kimis_format(tokenizer):
    messages = [USER, {"role": "assistant", "content": "", "tool_calls": [_call("add", {"a": 3, "b": 4})]},
                {"role": "tool", "name": "add", "content": "7"},
                {"role": "assistant", "content": "Now both.",
                 "tool_calls": [_call("multiply", '{"a": 7, "b": 2}'), _call("submit", {"answer": 14})]},
                {"role": "tool", "name": "multiply", "content": "14"},
                {"role": "tool", "name": "submit", "content": "submitted"}]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text == (
        '<|im_system|>tool_declare<|im_middle|>[{"type": "function", "function": {"name": "add", "parameters": {}}}]'
        "<|im_end|><|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
        "<|im_user|>user<|im_middle|>Start with 3, add 4.<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|><|tool_call_begin|>functions.add:0"
        '<|tool_call_argument_begin|>{"a": 3, "b": 4}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
        "<|im_system|>add<|im_middle|>## Return of functions.add:0\n7<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>Now both.<|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.multiply:1<|tool_call_argument_begin|>{"a": 7, "b": 2}<|tool_call_end|>'
        '<|tool_call_begin|>functions.submit:2<|tool_call_argument_begin|>{"answer": 14}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>"
        "<|im_system|>multiply<|im_middle|>## Return of functions.multiply:1\n14<|im_end|>"
        "<|im_system|>submit<|im_middle|>## Return of functions.submit:2\nsubmitted<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>")
    assert is_chat_template_prefix_preserving(tokenizer)  # what TRL's multi-turn loop needs


def _round_trip(tokenizer, message, history=(USER,), tools=None):
    """Render ``history + [message]`` (ids), cut at the generation prompt, parse the rest as TRL's loop does."""
    history = list(history)
    prefix = tokenizer.apply_chat_template(history, tools=tools, add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
    full = tokenizer.apply_chat_template(history + [message], tools=tools, tokenize=True, return_dict=False)
    assert full[:len(prefix)] == prefix
    return parse_response(tokenizer, full[len(prefix):], prefix=prefix, tools=tools)


@pytest.mark.parametrize("message", [
    {"role": "assistant", "content": "", "tool_calls": [_call("add", {"a": 3, "b": 4})]},
    {"role": "assistant", "content": "Two at once.",
     "tool_calls": [_call("add", {"a": 3, "b": 4}), _call("multiply", {"a": 7, "b": 2}),
                    _call("submit", {"answer": 1})]},
    {"role": "assistant", "content": "", "tool_calls": [_call("submit", {"answer": -12})]},
    {"role": "assistant", "content": "Done."},
], ids=["one_call", "three_calls_with_text", "negative", "text_only"])
def test_parse_round_trips_kimi_tool_calls(tokenizer, message):
    assert _round_trip(tokenizer, message, tools=TOOLS) == message
    later = [USER, {"role": "assistant", "content": "", "tool_calls": [_call("add", {"a": 3, "b": 4})]},
             {"role": "tool", "name": "add", "content": "7"}]  # a later turn: ids numbered from 1, prefix anchors
    assert _round_trip(tokenizer, message, history=later, tools=TOOLS) == message


def test_arguments_are_typed_by_the_tools_schema(tokenizer):
    # JSON text with a quoted number: the tool's schema says integer (transformers' parser casts it, as for Qwen)
    sent = {"role": "assistant", "content": "", "tool_calls": [_call("add", '{"a": "3", "b": 4}')]}
    parsed = _round_trip(tokenizer, sent, tools=TOOLS)
    assert parsed["tool_calls"] == [_call("add", {"a": 3, "b": 4})]


def test_malformed_arguments_fall_back_to_text_as_trl_does(tokenizer):
    prefix = tokenizer.apply_chat_template([USER], add_generation_prompt=True, tokenize=True, return_dict=False)
    text = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>{"a": 3,'
            "<|tool_call_end|><|tool_calls_section_end|><|im_end|>")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError):  # transformers' parser refuses the JSON ...
        tokenizer.parse_response(ids, prefix=prefix)
    # ... and TRL keeps the turn as its text without special tokens (no tool call): the markers are not special
    assert parse_response(tokenizer, ids, prefix=prefix) == {"role": "assistant", "content": text[:-len("<|im_end|>")]}


def test_kimi_format_is_detected_and_an_unknown_one_is_named(tokenizer, tmp_path):
    fresh = copy.deepcopy(tokenizer)
    fresh.response_template = None
    assert is_kimi_format(fresh) and attach_response_template(fresh, needs_tool_calls=True) == "kimi"
    assert fresh.response_template == KIMI_RESPONSE_TEMPLATE

    fresh.save_pretrained(tmp_path / "saved")  # the response template travels in tokenizer_config.json
    saved = json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())
    assert saved["response_template"] == KIMI_RESPONSE_TEMPLATE

    ours = train_tokenizer(["Start with 3, add 4."] * 4, vocab_size=300, min_frequency=1)
    assert not is_kimi_format(ours) and attach_response_template(ours, needs_tool_calls=True) == "kept"

    other = copy.deepcopy(ours)
    other.response_template = None
    other.name_or_path = "some/folder"
    assert attach_response_template(other, needs_tool_calls=False) == "none"
    with pytest.raises(ValueError, match="some/folder: its chat template is neither kdamoe's"):
        attach_response_template(other, needs_tool_calls=True)

    # Kimi's markers in the template are not enough: they must be tokens of the vocabulary
    lookalike = copy.deepcopy(ours)
    lookalike.chat_template = CHAT_TEMPLATE
    assert not is_kimi_format(lookalike)
    assert set(KIMI_MARKERS) <= {t["content"] for t in SPECIAL["tokens"]}


CONVERSATIONS = [
    ([USER, {"role": "assistant", "content": "", "tool_calls": [_call("add", {"a": 3, "b": 4})]},
      {"role": "tool", "name": "add", "content": "7"}, {"role": "assistant", "content": "Done."}], TOOLS),
    ([{"role": "system", "content": "sys"}, USER,
      {"role": "assistant", "content": "x", "tool_calls": [_call("add", '{"a": 1}'), _call("add", {"a": 2})]},
      {"role": "tool", "name": "add", "content": "1"}, {"role": "tool", "name": "add", "content": "2"},
      {"role": "tool", "name": "add", "content": "extra result"}], None),
]


@pytest.mark.parametrize("messages, tools", CONVERSATIONS, ids=["episode", "system_two_calls_extra_result"])
def test_the_training_template_renders_the_folders_text_and_masks_the_assistant(tokenizer, messages, tools):
    assert training_chat_template(tokenizer) == KIMI_TRAINING_CHAT_TEMPLATE
    for prompt in (False, True):
        own = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=prompt)
        marked = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=prompt,
                                               chat_template=KIMI_TRAINING_CHAT_TEMPLATE)
        assert marked == own
    out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True, chat_template=KIMI_TRAINING_CHAT_TEMPLATE)
    masked = [i for i, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m]
    # each assistant turn's text after its header, <|im_end|> included (the folder's own template renders it)
    wanted = "".join(
        tokenizer.apply_chat_template(messages[:k + 1], tools=tools, tokenize=False).rsplit(
            "<|im_assistant|>assistant<|im_middle|>", 1)[1]
        for k, m in enumerate(messages) if m["role"] == "assistant")
    assert wanted.count("<|im_end|>") == sum(m["role"] == "assistant" for m in messages)
    assert tokenizer.decode(masked, skip_special_tokens=False) == wanted


def test_a_kimi_template_the_copy_does_not_reproduce_is_refused(tokenizer):
    variant = copy.deepcopy(tokenizer)
    variant.chat_template = CHAT_TEMPLATE.replace("## Return of ", "## Outcome of ")
    variant.name_or_path = "kimi/variant"
    with pytest.raises(ValueError, match=r"kimi/variant: .* at character \d+: 'Outcome of"):
        training_chat_template(variant)
    marked = copy.deepcopy(tokenizer)
    marked.chat_template = KIMI_TRAINING_CHAT_TEMPLATE
    assert training_chat_template(marked) is None  # it has markers: TRL uses it as it is


def test_the_swap_restores_the_folders_template_on_error(tokenizer):
    own = tokenizer.chat_template
    with pytest.raises(RuntimeError), chat_template_swapped(tokenizer, "swapped"):
        assert tokenizer.chat_template == "swapped"
        raise RuntimeError
    assert tokenizer.chat_template == own


@pytest.mark.parametrize("environment", sorted(ENVIRONMENTS))
def test_every_environments_episodes_parse_back_through_kimis_format(tokenizer, environment):
    """The recipes' own conversations (each task family's scripted episodes, with its tools) rendered in Kimi's
    format: every assistant turn parses back to the message the episode holds (its JSON-text arguments as a dict)."""
    tasks = make_family_tasks(environment, 3, seed=2, min_calls=1, max_calls=2)
    tools = task_tool_schemas(tasks)
    for task in tasks:
        messages = [user_message(task), *episode_messages(task)]
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            want = copy.deepcopy(message)
            for call in want.get("tool_calls", []):
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
            assert _round_trip(tokenizer, message, history=messages[:k], tools=tools) == want, (task, k)


def test_a_kimi_template_that_appends_to_a_list_is_refused_with_the_fix(tokenizer):
    """A template that numbers calls by appending to a list (as the published Kimi K2 template does) cannot render
    in transformers' immutable sandbox; both recipes' checks say so and name the copy that renders."""
    appending = copy.deepcopy(tokenizer)
    appending.response_template = None
    appending.name_or_path = "kimi/appending"
    appending.chat_template = "{%- set queue = namespace(ids=[]) -%}{%- set _ = queue.ids.append(0) -%}" + CHAT_TEMPLATE
    for check in (lambda: attach_response_template(appending, needs_tool_calls=True),
                  lambda: training_chat_template(appending)):
        with pytest.raises(ValueError, match=r"kimi/appending: .*SecurityError.*KIMI_TRAINING_CHAT_TEMPLATE"):
            check()
    assert appending.response_template is None
    assert attach_response_template(appending, needs_tool_calls=False) == "kimi"  # nothing is rendered for SFT
