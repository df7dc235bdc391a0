"""A Kimi-style tokenizer built here (no download), for the tests of Kimi's chat format in the recipes.

The released Kimi Linear / Kimi K2 tokenizer is a tiktoken BPE loaded by remote code; what the recipes depend on is
its special tokens, their ids and flags, and its chat format. :func:`build_kimi_tokenizer` trains a small byte-level
BPE (the `tokenizers` library) and appends the 256 reserved ids the release puts after its base vocabulary, with
the released tokens at their offsets and flags (``tests/fixtures/kimi_linear/special_tokens.json``) and the chat
template of ``tests/fixtures/kimi_linear/chat_template.jinja``. Like the release, the tool-call markers are added
tokens that are *not* special (a decode that skips special tokens keeps them), and ``eos_token`` is ``[EOS]`` while
a turn ends with ``<|im_end|>`` (the model config's ``eos_token_id``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "kimi_linear"
SPECIAL = json.loads((FIXTURES / "special_tokens.json").read_text())
CHAT_TEMPLATE = (FIXTURES / "chat_template.jinja").read_text()


def build_kimi_tokenizer(texts: Iterable[str], base_vocab_size: int = 300) -> PreTrainedTokenizerFast:
    """A byte-level BPE of at most ``base_vocab_size`` tokens trained on ``texts``, then Kimi's 256 reserved ids.

    Returns:
        A ``PreTrainedTokenizerFast``: ids ``[0, n_base)`` the BPE, ``n_base + offset`` each released token (the
        rest ``<|reserved_token_{id}|>``), ``len(tokenizer) == n_base + 256``; bos/eos/pad/unk as released; the
        fixture chat template. ``tokenizer(text)`` adds no special token (nor does the release).
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=base_vocab_size, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(texts), trainer=trainer)
    n_base = tok.get_vocab_size()
    named = {t["offset"]: t for t in SPECIAL["tokens"]}
    for offset in range(SPECIAL["reserved"]):  # one at a time: each takes the next id
        spec = named.get(offset, {"content": f"<|reserved_token_{n_base + offset}|>", "special": True})
        token = AddedToken(spec["content"], special=spec["special"], normalized=False)
        (tok.add_special_tokens if spec["special"] else tok.add_tokens)([token])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIAL["bos_token"], eos_token=SPECIAL["eos_token"],
        pad_token=SPECIAL["pad_token"], unk_token=SPECIAL["unk_token"], chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False)
    return tokenizer


def kimi_token_id(tokenizer, offset: int) -> int:
    """The id of the released token at ``offset`` in ``tokenizer`` (``n_base + offset``)."""
    return len(tokenizer) - SPECIAL["reserved"] + offset
