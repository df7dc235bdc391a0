"""The end of a run: a Hub-ready model folder, reloading it, and sampling text from it."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, TextStreamer

from ..common.cards import count_parameters, pretraining_card_metadata, render_model_card
from ..common.folders import check_model_folder, write_model_folder
from .config import config_to_dict


def export_model(model, tokenizer, cfg, summary: dict, folder: str | Path, repo_id: str | None = None) -> Path:
    """Write the run's Hub folder (:func:`kdamoe.common.folders.write_model_folder`): what ``kdamoe-push`` publishes.

    Holds ``model.safetensors``, ``config.json`` (``auto_map`` for every head), the modeling code,
    ``generation_config.json`` (the run's sampling settings), the tokenizer with its chat template
    (``model_max_length`` = ``max_position_embeddings``) and ``README.md`` rendered by
    :func:`kdamoe.common.cards.render_model_card` with :func:`pretraining_card_metadata` (datasets, stages,
    validation perplexity / bits per byte as ``model-index``).

    Args:
        summary: needs ``before``, ``after`` and ``bigram`` metric dicts (see
            :func:`kdamoe.training.evaluate.evaluate_lm`).
        repo_id: the card's Hub id (default: none, the usage code loads ``folder``; ``kdamoe-push`` re-renders it).
    Returns:
        The folder.
    """
    folder = Path(folder)
    g = cfg.generate
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        do_sample=g.do_sample, temperature=g.temperature, top_k=g.top_k, max_new_tokens=g.max_new_tokens)
    total, active = count_parameters(model)
    # Without a repo id the card's usage code loads this folder (with a note): no guessed Hub id.
    card = render_model_card(model.config, repo_id=repo_id, local_path=str(folder.expanduser().resolve()),
                             total=total, active=active, chat_template=bool(tokenizer.chat_template),
                             **pretraining_card_metadata(config_to_dict(cfg), summary))
    return write_model_folder(model, tokenizer, folder, card)


def reload_model(folder: str | Path, device: torch.device | str = "cpu"):
    """Load an exported folder through the Auto classes with its own copied code (``trust_remote_code``); a local
    folder's weights are checked first (:func:`kdamoe.common.folders.check_model_folder`: no missing, foreign, misshapen
    or non-finite tensor is loaded silently)."""
    if Path(folder).is_dir():
        check_model_folder(folder)
    model = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True)
    return model.to(device).eval()


def encode_prompt(tokenizer, prompt: str, chat: bool = False) -> torch.Tensor:
    """``[1, T]`` ids: the chat-formatted user turn with a generation prompt, or ``bos + prompt`` for raw text."""
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
    else:
        ids = [tokenizer.bos_token_id, *tokenizer(prompt, add_special_tokens=False)["input_ids"]]
    return torch.tensor([ids], dtype=torch.long)


@torch.no_grad()
def generate_text(model, tokenizer, prompt: str, device: torch.device | str = "cpu", stream: bool = False,
                  chat: bool = False, seed: int = 0, **generate_kwargs) -> str:
    """Continue ``prompt``; with ``stream`` the text is printed as it comes (``TextStreamer``). Returns the
    continuation.

    ``generate_kwargs`` override the model's ``generation_config`` (e.g. ``max_new_tokens``, ``do_sample``).
    """
    torch.manual_seed(seed)
    input_ids = encode_prompt(tokenizer, prompt, chat).to(device)
    streamer = TextStreamer(tokenizer, skip_prompt=False, skip_special_tokens=True) if stream else None
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), streamer=streamer,
                         **generate_kwargs)
    return tokenizer.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True)


def print_samples(model, tokenizer, gen_cfg, device: torch.device | str = "cpu") -> list[str]:
    """Print one sample per prompt of ``gen_cfg`` (a :class:`kdamoe.training.config.GenerateConfig`); returns them."""
    samples = []
    for i, prompt in enumerate(gen_cfg.prompts):
        text = generate_text(model, tokenizer, prompt, device, seed=i, max_new_tokens=gen_cfg.max_new_tokens,
                             do_sample=gen_cfg.do_sample, temperature=gen_cfg.temperature, top_k=gen_cfg.top_k)
        samples.append(text)
        print(f"--- sample {i + 1} ---\n{prompt}{text}\n", flush=True)
    return samples


def load_for_generation(folder: str | Path, device: torch.device | str = "cpu"):
    """``(model, tokenizer)`` from an exported folder."""
    return reload_model(folder, device), AutoTokenizer.from_pretrained(str(folder), trust_remote_code=True)
