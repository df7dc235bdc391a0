"""The byte-level BPE tokenizer: special tokens, chat template with tools, byte lengths."""

import random

import pytest
from transformers import AutoTokenizer
from trl.chat_template_utils import (
    is_chat_template_prefix_preserving,
    is_chat_template_stop_token_trained,
    supports_tool_calling,
)

from kdamoe.training.data import tokenize_documents
from kdamoe.training.export import encode_prompt
from kdamoe.training.tokenizer import BOS, EOS, PAD, TOOL_TOKENS, TURN_START, token_byte_lengths, train_tokenizer

WORDS = "the king queen lord speak thou thee hath doth night day love death sword crown ghost".split()


def _texts(n=40, seed=0):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(60)) + ".\nÆnd naïve café — ok!" for _ in range(n)]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(_texts(), vocab_size=400)


def test_special_tokens(tokenizer):
    assert 256 + 4 + len(TOOL_TOKENS) < len(tokenizer) <= 400  # this small corpus has fewer merges
    assert len(train_tokenizer(_texts() * 5, vocab_size=300, min_frequency=1)) == 300
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (BOS, EOS, PAD)
    assert tokenizer.eos_token == "<|im_end|>"  # end of turn ends generation
    ids = {tokenizer.convert_tokens_to_ids(t) for t in [BOS, EOS, PAD, TURN_START, *TOOL_TOKENS]}
    assert len(ids) == 4 + len(TOOL_TOKENS) and tokenizer.unk_token_id not in ids
    # tool markup is one token each and survives skip_special_tokens
    text = "<tool_call>\n{}\n</tool_call><|im_end|>"
    enc = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_tokens_to_ids("<tool_call>") in enc
    assert tokenizer.decode(enc, skip_special_tokens=True) == "<tool_call>\n{}\n</tool_call>"


def test_roundtrip_and_byte_lengths(tokenizer):
    lengths = token_byte_lengths(tokenizer)
    for text in _texts(5, seed=1) + ["\t  zzz ~ ünïcödé 日本語 🙂"]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
        assert sum(lengths[i] for i in ids) == len(text.encode("utf-8"))
    assert lengths[tokenizer.bos_token_id] == lengths[tokenizer.eos_token_id] == 0
    assert lengths[tokenizer.convert_tokens_to_ids("<tool_call>")] == len("<tool_call>")


def test_chat_template_tools_and_prefix(tokenizer):
    assert supports_tool_calling(tokenizer)
    assert is_chat_template_prefix_preserving(tokenizer)
    assert is_chat_template_stop_token_trained(tokenizer)

    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}]},
        {"role": "tool", "name": "get_time", "content": "12:00"},
        {"role": "assistant", "content": "Noon."},
    ]
    full = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert '"name": "get_time"' in full and "<tools>" in full and "Be brief." in full
    assert '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call><|im_end|>' in full
    assert "<|im_start|>tool\n<tool_response>\n12:00\n</tool_response><|im_end|>" in full
    for n in range(1, len(messages)):
        prefix = tokenizer.apply_chat_template(messages[:n], tools=tools, tokenize=False)
        assert full.startswith(prefix)
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")


def test_response_parsing_and_save(tokenizer, tmp_path):
    reply = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call><|im_end|>'
    parsed = tokenizer.parse_response(reply, prefix="<|im_start|>assistant\n")
    assert parsed["content"].strip() == "Sure."
    assert parsed["tool_calls"] == [{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]

    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.eos_token == EOS and loaded.chat_template == tokenizer.chat_template
    assert loaded.response_template == tokenizer.response_template
    assert loaded("the king")["input_ids"] == tokenizer("the king")["input_ids"]


def test_vocab_too_small():
    with pytest.raises(ValueError, match="tokenizer.vocab_size"):
        train_tokenizer(["abc"], vocab_size=100)


def test_saved_tokenizer_prepends_bos_once_like_training(tokenizer, tmp_path):

    tokenizer.save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    text = "ROMEO.\nthe king doth speak"
    plain = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.bos_token_id not in plain
    assert tok("ROMEO.")["input_ids"][0] == tok.bos_token_id
    assert tok(text)["input_ids"] == [tok.bos_token_id, *plain]  # what pipeline("text-generation") encodes
    assert encode_prompt(tok, text)[0].tolist() == [tok.bos_token_id, *plain]  # kdamoe-generate
    (doc,) = tokenize_documents(tok, [text], bos_id=tok.bos_token_id, eos_id=tok.eos_token_id)
    assert doc == [tok.bos_token_id, *plain, tok.eos_token_id]  # training: one bos, one eos
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False)
    assert chat.count(tok.bos_token_id) <= 1
