"""Byte-level BPE tokenizer with chat and tool-call markup, as a transformers ``PreTrainedTokenizerFast``.

Special tokens: ``<|bos|>`` starts every document (the post-processor adds it: ``tokenizer(text)`` is
``[bos] + tokens`` as in training; ``add_special_tokens=False`` leaves it out), ``<|im_end|>`` ends a chat turn *and* a
document (it is ``eos_token``, so generation stops at the end of a turn), ``<|pad|>`` pads. ``<|im_start|>``
opens a turn. Tool markup (``<tools>``, ``<tool_call>``, ``<tool_response>`` and their closers) is
added as *non-special* tokens so decoding with ``skip_special_tokens=True`` keeps tool calls.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

BOS, EOS, PAD, TURN_START = "<|bos|>", "<|im_end|>", "<|pad|>", "<|im_start|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, TURN_START]
TOOL_TOKENS = ["<tools>", "</tools>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# Every message renders on its own (no look-ahead, no look-back), so rendering a conversation's
# first n messages gives a prefix of rendering all of them: the template is prefix-preserving.
# `{% generation %}` marks what an assistant produces, its end-of-turn token included.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- 'You may call these tools. Put each call in <tool_call></tool_call> as JSON with "
    "\"name\" and \"arguments\".\\n<tools>' }}"
    # One line per tool, `name(arg: type, ...) -> type: description`: a small vocabulary spends ~250 tokens
    # on a tool's JSON schema and ~25 on this line, and the tool loop's budget is the whole context.
    "{%- for tool in tools %}"
    "{%- set fn = tool.function if tool.function is defined else tool %}"
    "{{- '\\n' + fn.name + '(' }}"
    "{%- for arg, spec in ((fn.parameters or {}).properties or {}).items() %}"
    "{{- arg + ': ' + (spec.type | string) }}{%- if not loop.last %}{{- ', ' }}{%- endif %}"
    "{%- endfor %}"
    "{{- ')' }}"
    "{%- if fn['return'] is defined %}{{- ' -> ' + (fn['return'].type | string) }}{%- endif %}"
    "{%- if fn.description %}{{- ': ' + fn.description }}{%- endif %}"
    "{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages and messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}"
    "{{- message.content if message.content is string else '' }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{%- if (message.content is string and message.content) or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn.name + '\", \"arguments\": ' }}"
    "{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>' }}"
    "{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>tool\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# transformers' new-style response parser (``tokenizer.parse_response``): where an assistant reply
# starts, and how its tool calls and text content are delimited.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096, min_frequency: int = 2,
                    model_max_length: int = 1 << 20) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts`` and wrap it for transformers.

    Args:
        texts: training documents (only the training split: validation must stay unseen).
        vocab_size: final vocabulary size, special and tool tokens included; at least 256 + 10
            (every byte has a token, so any text encodes).
        min_frequency: a pair must occur this often to be merged.
        model_max_length: stored in the tokenizer config (the model's context, for warnings); the
            exported copy gets the model's ``max_position_embeddings`` (``export.export_model``).
    Returns:
        A ``PreTrainedTokenizerFast`` with ``bos/eos/pad`` set, a ``TemplateProcessing`` post-processor
        that prepends ``<|bos|>`` (transformers' ``add_bos_token``), :data:`CHAT_TEMPLATE` and
        :data:`RESPONSE_TEMPLATE`; ``len(tokenizer) == vocab_size`` unless the texts
        allow fewer merges (then it is smaller).
    Raises:
        ValueError: ``vocab_size`` is too small.
    """
    n_reserved = len(SPECIAL_TOKENS) + len(TOOL_TOKENS)
    if vocab_size < 256 + n_reserved:
        raise ValueError(f"tokenizer.vocab_size must be at least {256 + n_reserved}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TOOL_TOKENS), min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, model_max_length=model_max_length,
        chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False, add_bos_token=True,
    )
    # Saved to tokenizer_config.json too, so a reload that rebuilds the post-processor keeps the bos.
    tokenizer.init_kwargs["add_bos_token"] = True
    tokenizer.response_template = RESPONSE_TEMPLATE
    return tokenizer


def _byte_decoder() -> dict[str, int]:
    """Inverse of the byte-level alphabet: printable stand-in character → byte value (GPT-2's mapping)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_byte_lengths(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """UTF-8 bytes each token id stands for: ``out[i]`` for ``i < len(tokenizer)``.

    Special tokens count 0 bytes (they are not text); non-special added tokens count their UTF-8
    length. Used for bits per byte: ``bpb = Σ nll / ln 2 / Σ bytes(target)``.
    """
    inverse = _byte_decoder()
    special = set(tokenizer.all_special_ids)
    added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
    out = [0] * len(tokenizer)
    for token, i in tokenizer.get_vocab().items():
        if i in special:
            out[i] = 0
        elif i in added:
            out[i] = len(added[i].encode("utf-8"))
        else:
            out[i] = len(token) if all(c in inverse for c in token) else len(token.encode("utf-8"))
    return out
