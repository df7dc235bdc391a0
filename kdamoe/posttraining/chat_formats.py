"""Chat formats of a base model's own tokenizer in the recipes: Kimi's tool-call format, response parsing for TRL's
tool loop, and a chat template TRL can mask for assistant-only SFT.

A post-training run uses the tokenizer and chat template saved in the base folder (``AutoTokenizer`` of
``cfg.model``), which for a converted Kimi Linear model is Kimi's, not kdamoe's. Two parts of TRL 1.16 need more
than the template itself:

* **Tool-call parsing** (GRPO ``tools`` / ``environment`` modes, :mod:`.rollout`, :mod:`.agent`): TRL reads an
  assistant turn with ``parse_response``, i.e. transformers' response parser driven by
  ``tokenizer.response_template`` (transformers >= 5.13). ``trl.chat_template_utils.add_response_schema`` sets one
  only for the templates it knows (Qwen, Llama 3, GLM-4-MoE, GPT-OSS, ...) and raises "Unrecognized chat template"
  for Kimi's. :func:`attach_response_template` keeps a template the tokenizer already has (kdamoe's tokenizer saves
  its own), sets :data:`KIMI_RESPONSE_TEMPLATE` for a Kimi tokenizer (:func:`is_kimi_format`), else asks TRL.
* **Assistant-only SFT loss** (``assistant_only_loss=True``, the SFT recipe's default): TRL masks the assistant turns
  by the template's ``{% generation %}`` markers, which Kimi's released template has none of, and
  ``get_training_chat_template`` has no patched copy of it. :func:`training_chat_template` returns
  :data:`KIMI_TRAINING_CHAT_TEMPLATE` — Kimi's format with the markers — but only after checking that it renders
  exactly the text the tokenizer's own template renders on :data:`PROBE_CONVERSATIONS`; the SFT recipe tokenizes its
  data with it and leaves the tokenizer's own template in place (what ``final/`` saves).

Kimi's format (Kimi K2 / Kimi Linear instruct models): a turn is ``<|im_user|>`` / ``<|im_assistant|>`` /
``<|im_system|>``, the message's name (its ``name``, else its role), ``<|im_middle|>``, the text, ``<|im_end|>``, with
nothing between turns; tool schemas open the conversation as a ``tool_declare`` system turn (``tools | tojson``); a
conversation without a system turn first gets Kimi's default one. An assistant's calls follow its text:
``<|tool_calls_section_begin|>``, per call ``<|tool_call_begin|>ID<|tool_call_argument_begin|>JSON<|tool_call_end|>``,
then ``<|tool_calls_section_end|>``; ``ID`` is the call's ``id`` or ``functions.NAME:INDEX`` (``INDEX`` counting the
conversation's calls from 0). A tool result is a system-side turn named after the tool whose text is
``## Return of ID``, a newline and the result. The assistant turn ends with ``<|im_end|>``, the model config's
``eos_token_id``; the tokenizer's own ``eos_token`` is ``[EOS]``.

Sources of the format: the chat template published with Kimi K2 Instruct (turns, ``tool_declare``, the call and
result layout; it numbers calls with a list it appends to, which transformers' sandbox refuses, so the copy here counts
with namespace attributes), and the tokenizer files published with Kimi Linear 48B A3B Instruct
(``tokenization_kimi.py``: bos ``[BOS]``, eos ``[EOS]``, the chat markers as special tokens, 256 reserved ids after
the base vocabulary; ``tokenizer_config.json``: the tool-call markers as added tokens that are not special). Kimi
Linear's own chat template was not available to compare with; :func:`training_chat_template` checks a folder's
template against the copy before using it.
"""

from __future__ import annotations

from contextlib import contextmanager

from jinja2 import TemplateError
from trl.chat_template_utils import add_response_schema, has_generation_markers

KIMI_TURN_END = "<|im_end|>"
# Every token Kimi's format is made of; a tokenizer must have each as one added token (Kimi's own do).
KIMI_MARKERS = ("<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", KIMI_TURN_END,
                "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                "<|tool_call_argument_begin|>", "<|tool_call_end|>")

# transformers' response-template format (`tokenizer.parse_response`, utils/chat_parsing): the text after the last
# assistant header is split into the calls (each `<|tool_call_begin|>ID<|tool_call_argument_begin|>JSON
# <|tool_call_end|>`, the section markers swallowed by the first call's open and the last call's close) and the rest,
# which is the content up to `<|im_end|>`. The tool name is ID without the `functions.` prefix and `:INDEX` suffix;
# arguments that are not JSON make the parser raise, and TRL's `parse_response` then keeps the turn as plain text.
KIMI_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_assistant|>assistant<|im_middle|>",
    "fields": {
        "tool_calls": {
            "open_pattern": (r"\s*(?:<\|tool_calls_section_begin\|>\s*)?<\|tool_call_begin\|>\s*(?:functions\.)?"
                             r"(?P<name>[^<:\s]+)(?::\d+)?\s*<\|tool_call_argument_begin\|>"),
            "close_pattern": r"\s*<\|tool_call_end\|>(?:\s*<\|tool_calls_section_end\|>)?",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {"close_pattern": r"<\|im_end\|>", "content": "text"},
    },
}

# Kimi's format (module docstring) with `{% generation %}` around what an assistant writes, `<|im_end|>` included.
# Only namespace attributes are assigned: transformers renders chat templates in an immutable sandbox.
KIMI_TRAINING_CHAT_TEMPLATE = (
    "{%- macro text_of(m) -%}"
    "{%- if m.content is string -%}{{ m.content }}"
    "{%- elif m.content is not none and m.content is not undefined -%}"
    "{%- for part in m.content -%}{%- if part.type == 'text' -%}{{ part.text }}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- macro call_id(call, index) -%}"
    "{%- if call.id is defined and call.id -%}{{ call.id }}"
    "{%- else -%}{{ 'functions.' + (call.function.name if call.function is defined else call.name) + ':' "
    "+ (index | string) }}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set s = namespace(calls=0, last_calls=[], first=0, answered=0) -%}"
    "{%- if tools -%}{{ '<|im_system|>tool_declare<|im_middle|>' + (tools | tojson) + '<|im_end|>' }}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if loop.first and m.role != 'system' -%}"
    "{{ '<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>' }}"
    "{%- endif -%}"
    "{%- set name = m.name if m.name is defined and m.name else m.role -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{ '<|im_assistant|>' + name + '<|im_middle|>' }}"
    "{%- generation -%}"
    "{{ text_of(m) }}"
    "{%- if m.tool_calls -%}"
    "{{ '<|tool_calls_section_begin|>' }}"
    "{%- for call in m.tool_calls -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{{ '<|tool_call_begin|>' + call_id(call, s.calls + loop.index0) + '<|tool_call_argument_begin|>' }}"
    "{%- if fn.arguments is string -%}{{ fn.arguments }}{%- else -%}{{ fn.arguments | tojson }}{%- endif -%}"
    "{{ '<|tool_call_end|>' }}"
    "{%- endfor -%}"
    "{{ '<|tool_calls_section_end|>' }}"
    "{%- set s.first = s.calls -%}{%- set s.last_calls = m.tool_calls -%}"
    "{%- set s.calls = s.calls + (m.tool_calls | length) -%}{%- set s.answered = 0 -%}"
    "{%- endif -%}"
    "{{ '<|im_end|>' }}"
    "{%- endgeneration -%}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if m.tool_call_id is defined and m.tool_call_id -%}{%- set rid = m.tool_call_id -%}"
    "{%- elif s.answered < (s.last_calls | length) -%}"
    "{%- set rid = call_id(s.last_calls[s.answered], s.first + s.answered) -%}"
    "{%- else -%}{%- set rid = 'functions.' + name + ':' + ((s.first + s.answered) | string) -%}"
    "{%- endif -%}"
    "{%- set s.answered = s.answered + 1 -%}"
    "{{ '<|im_system|>' + name + '<|im_middle|>## Return of ' + rid + '\\n' + text_of(m) + '<|im_end|>' }}"
    "{%- else -%}"
    "{{ ('<|im_user|>' if m.role == 'user' else '<|im_system|>') + name + '<|im_middle|>' + text_of(m) }}"
    "{{ '<|im_end|>' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_assistant|>assistant<|im_middle|>' }}{%- endif -%}"
)


def _call(name: str, arguments, call_id: str | None = None) -> dict:
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return call if call_id is None else {**call, "id": call_id}


_PROBE_TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]

# What :func:`training_chat_template` renders with both templates: every kind of turn the recipes' data has (user
# task, assistant calls with dict or JSON-text arguments, several calls in a turn, tool results, a final answer), a
# system turn, text next to calls, explicit call ids, a named user, and the generation prompt.
PROBE_CONVERSATIONS = (
    ([{"role": "user", "content": "Start with 3, add 4. Submit the result."},
      {"role": "assistant", "content": "", "tool_calls": [_call("add", {"a": 3, "b": 4})]},
      {"role": "tool", "name": "add", "content": "7"},
      {"role": "assistant", "content": "", "tool_calls": [_call("submit", '{"answer": 7}')]},
      {"role": "tool", "name": "submit", "content": "submitted"},
      {"role": "assistant", "content": "Done."}], _PROBE_TOOLS, False),
    ([{"role": "system", "content": "Be brief."},
      {"role": "user", "name": "ann", "content": "two sums"},
      {"role": "assistant", "content": "Both at once.",
       "tool_calls": [_call("add", {"a": 1, "b": 2}), _call("add", {"a": 5, "b": 6}, call_id="functions.add:9")]},
      {"role": "tool", "name": "add", "content": "3"},
      {"role": "tool", "name": "add", "content": "11", "tool_call_id": "functions.add:9"}], None, True),
    ([{"role": "user", "content": "hi"}], None, True),
)


def is_kimi_format(tokenizer) -> bool:
    """Whether ``tokenizer`` uses Kimi's chat format: each of :data:`KIMI_MARKERS` is one added token of its
    vocabulary and its chat template writes the assistant header and the tool-call section."""
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("default")
    if not isinstance(template, str):
        return False
    added = {token.content for token in tokenizer.added_tokens_decoder.values()}
    return all(m in added for m in KIMI_MARKERS) and all(
        m in template for m in ("<|im_assistant|>", "<|im_middle|>", "<|tool_calls_section_begin|>"))


def _source(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", "") or "the tokenizer"


def _render(tokenizer, messages, tools, generation_prompt, template=None) -> str:
    """``apply_chat_template`` text of a probe; a template transformers cannot render becomes a ``ValueError``."""
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                             tokenize=False, chat_template=template)
    except TemplateError as err:  # e.g. a list.append, which transformers' immutable sandbox refuses
        raise ValueError(
            f"{_source(tokenizer)}: its Kimi chat template cannot render a tool-calling conversation in transformers "
            f"({type(err).__name__}: {err}). kdamoe's copy of Kimi's format renders in transformers' sandbox: save "
            "kdamoe.posttraining.chat_formats.KIMI_TRAINING_CHAT_TEMPLATE as the folder's chat_template.jinja") from err


def attach_response_template(tokenizer, *, needs_tool_calls: bool) -> str:
    """Give ``tokenizer`` the ``response_template`` TRL's tool loop parses assistant turns with, when it has none.

    Args:
        tokenizer: the base folder's tokenizer (modified in place).
        needs_tool_calls: the recipe parses tool calls (GRPO ``tools`` / ``environment``): a tokenizer whose format
            is unknown is then an error instead of being left without a parser.
    Returns:
        How it was set: ``"kept"`` (it had one: kdamoe's tokenizer saves its own), ``"kimi"``
        (:data:`KIMI_RESPONSE_TEMPLATE`, :func:`is_kimi_format`), ``"trl"`` (TRL's ``add_response_schema`` knew the
        template) or ``"none"`` (unknown format, and ``needs_tool_calls`` is false).
    Raises:
        ValueError: ``needs_tool_calls`` and the chat template is none of those, or a Kimi template that transformers
            cannot render (a list it appends to, say), naming the tokenizer's source.
    """
    if getattr(tokenizer, "response_template", None) is not None:
        return "kept"
    if is_kimi_format(tokenizer):
        if needs_tool_calls:  # TRL renders tool turns with the folder's template: it must get through the sandbox
            for messages, tools, generation_prompt in PROBE_CONVERSATIONS:
                _render(tokenizer, messages, tools, generation_prompt)
        tokenizer.response_template = KIMI_RESPONSE_TEMPLATE
        return "kimi"
    try:
        add_response_schema(tokenizer)
    except ValueError as err:
        if needs_tool_calls:
            raise ValueError(
                f"{_source(tokenizer)}: its chat template is neither kdamoe's (which saves a response_template), "
                f"Kimi's (markers {', '.join(KIMI_MARKERS[:4])}, ... as added tokens) nor one TRL knows ({err}); tool "
                "calls cannot be parsed. Set tokenizer.response_template (transformers' response-parsing format) and "
                "save the tokenizer into the model folder, or use a recipe mode without tools") from None
        return "none"
    return "trl" if getattr(tokenizer, "response_template", None) is not None else "none"


def _first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def training_chat_template(tokenizer) -> str | None:
    """The chat template assistant-only SFT should tokenize with, when it is not the tokenizer's own.

    Returns:
        ``None`` when the tokenizer's template already has ``{% generation %}`` markers (kdamoe's) or is not Kimi's
        (TRL's ``get_training_chat_template`` then handles it: a patched copy for templates it knows, else its own
        error); :data:`KIMI_TRAINING_CHAT_TEMPLATE` for a Kimi tokenizer whose template renders the same text on every
        conversation of :data:`PROBE_CONVERSATIONS`.
    Raises:
        ValueError: a Kimi tokenizer whose template renders a probe differently (a Kimi variant this copy does not
            reproduce), naming the first differing characters (add ``{% generation %}`` markers to the folder's
            ``chat_template.jinja``, or set ``trainer.assistant_only_loss=false``); or one transformers cannot render.
    """
    template = tokenizer.chat_template
    if template is None or has_generation_markers(template) or not is_kimi_format(tokenizer):
        return None
    for messages, tools, generation_prompt in PROBE_CONVERSATIONS:
        own = _render(tokenizer, messages, tools, generation_prompt)
        ours = _render(tokenizer, messages, tools, generation_prompt, KIMI_TRAINING_CHAT_TEMPLATE)
        if own != ours:
            at = _first_difference(own, ours)
            raise ValueError(
                f"{_source(tokenizer)}: its Kimi chat template has no "
                "{% generation %} markers (assistant_only_loss needs them) and renders differently from kdamoe's "
                f"marked copy of Kimi's format at character {at}: {own[at:at + 60]!r} vs {ours[at:at + 60]!r}. Add "
                "the markers to the folder's chat_template.jinja, or set trainer.assistant_only_loss=false")
    return KIMI_TRAINING_CHAT_TEMPLATE


@contextmanager
def chat_template_swapped(tokenizer, template: str | None):
    """Within the block the tokenizer's ``chat_template`` is ``template`` (unchanged when ``None``); restored after,
    error or not, so what a run saves is the folder's own template."""
    if template is None:
        yield tokenizer
        return
    own = tokenizer.chat_template
    tokenizer.chat_template = template
    try:
        yield tokenizer
    finally:
        tokenizer.chat_template = own
