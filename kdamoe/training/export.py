"""The end of a run: a Hub-ready model folder, reloading it, and sampling text from it."""

from __future__ import annotations

from pathlib import Path

import torch
from huggingface_hub import ModelCard, ModelCardData
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, TextStreamer

MODEL_CARD_TEMPLATE = "pretrained_model_card.md"


def model_card_template() -> Path | None:
    """The card template: ``model_cards/`` of the source checkout, else ``kdamoe/model_cards/`` package data."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here.parent / "model_cards" / MODEL_CARD_TEMPLATE, here / "model_cards" / MODEL_CARD_TEMPLATE):
        if candidate.is_file():
            return candidate
    return None


def export_model(model, tokenizer, cfg, summary: dict, folder: str | Path) -> Path:
    """Write ``folder`` so that ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` loads it.

    Holds ``model.safetensors``, ``config.json`` (with ``auto_map``) and the modeling code (copied by
    ``save_pretrained``), ``generation_config.json``, the tokenizer files (``model_max_length`` set to the
    model's ``max_position_embeddings``) and a ``README.md`` model
    card rendered from ``model_cards/pretrained_model_card.md`` with the run's numbers.

    Args:
        summary: needs ``before``, ``after`` and ``bigram`` metric dicts (see :func:`kdamoe.training.evaluate.evaluate_lm`).
    Returns:
        The folder.
    """
    folder = Path(folder)
    g = cfg.generate
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        do_sample=g.do_sample, temperature=g.temperature, top_k=g.top_k, max_new_tokens=g.max_new_tokens)
    # The run may have forced a backend (e.g. torch on a CPU); the shipped model picks its own.
    trained_backend, model.config.kernel_backend = model.config.kernel_backend, "auto"
    try:
        model.save_pretrained(folder)
    finally:
        model.config.kernel_backend = trained_backend
    # The tokenizer's context limit is the model's (it was trained before the model existed).
    trained_max_length, tokenizer.model_max_length = tokenizer.model_max_length, model.config.max_position_embeddings
    try:
        tokenizer.save_pretrained(folder)
    finally:
        tokenizer.model_max_length = trained_max_length
    c = model.config
    card_data = ModelCardData(language="en", license="apache-2.0", library_name="transformers",
                              pipeline_tag="text-generation", tags=["kda_moe", "linear-attention", "moe", "custom_code"])
    values = dict(
        model_id=f"kdamoe-{Path(cfg.output_dir).name}",
        num_parameters=f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M",
        hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers, layer_types=", ".join(c.layer_types),
        num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok, vocab_size=c.vocab_size,
        data_source=cfg.data.source, stages=cfg.train.stages, tokens=summary.get("tokens", "n/a"),
        before=summary["before"], after=summary["after"], bigram=summary["bigram"],
    )
    template = model_card_template()
    card = (ModelCard.from_template(card_data, template_path=str(template), **values) if template
            else ModelCard.from_template(card_data, model_id=values["model_id"]))
    card.save(folder / "README.md")
    return folder


def reload_model(folder: str | Path, device: torch.device | str = "cpu"):
    """Load an exported folder through the Auto classes with its own copied code (``trust_remote_code``)."""
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
    """Continue ``prompt``; with ``stream`` the text is printed as it comes (``TextStreamer``). Returns the continuation.

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
