"""Post-training recipes (TRL 1.16) on a tiny KDAMoE base folder: SFT, GRPO (tools / environment), DPO, RLOO,
LoRA on the fused experts, config errors, the kdamoe-posttrain CLI with resume.

The GRPO tool tests drive TRL's real tool loop with a *scripted* policy (the model's ``generate`` replaced by a
careful / hasty agent reading the rendered conversation), since a tiny random model never writes a tool call;
the policy takes each operand from the last tool result, so a right answer needs the tools to have run.
"""

import json
import json as json_module
import logging
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import get_json_schema
from trl import SFTConfig

import kdamoe.posttraining
from kdamoe import KDAMoEForCausalLM, hub
from kdamoe.callbacks import RouterBiasUpdateCallback, add_router_bias_callback
from kdamoe.cli import posttrain_main
from kdamoe.common.cards import render_model_card
from kdamoe.common.run_folder import RunFolderError
from kdamoe.posttraining import load_posttrain_config, run_recipe
from kdamoe.posttraining.environments import tool_schemas
from kdamoe.posttraining.environments.arithmetic import ArithmeticEnvironment, ArithmeticTask, make_tasks
from kdamoe.posttraining.long_update import real_token_span
from kdamoe.posttraining.recipes import build_trainer
from kdamoe.posttraining.recipes import grpo as grpo_recipe
from kdamoe.posttraining.recipes.common import trainer_args
from kdamoe.posttraining.run import card_values, plot_curve
from kdamoe.training.tokenizer import train_tokenizer
from tests.helpers import tiny_config

FAST = ["trainer.max_steps=1", "trainer.warmup_steps=0", "trainer.per_device_train_batch_size=2",
        "trainer.save_strategy='no'", "data.num_tasks=4", "data.environment=arithmetic", "data.min_calls=1",
        "data.max_calls=1", "data.max_operand=5"]
RL_FAST = FAST + ["trainer.num_generations=2"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny base folder: a 4-layer KDAMoE (Quantile Balancing) and a 300-token tokenizer trained on task text."""
    folder = tmp_path_factory.mktemp("base")
    tasks = make_tasks(40, seed=5, max_ops=2, max_operand=5)
    texts = [t.prompt() + ' <tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call> submitted Done.'
             for t in tasks]
    tokenizer = train_tokenizer(texts, vocab_size=300, min_frequency=1)
    torch.manual_seed(0)
    config = tiny_config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         max_position_embeddings=1024, kda_head_dim=16)  # final/ reloads with kernel_backend="auto"
    KDAMoEForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _cfg(name, base, tmp_path, *overrides):
    return load_posttrain_config(name, [f"model={base}", f"output_dir={tmp_path / name}", *overrides])


def _biases(model):
    return torch.stack([r.e_score_correction_bias.detach().clone() for r in model._routers()])


# ---------------------------------------------------------------------------------------------------- SFT


def _token_loss_sum(trainer):
    """(sum of per-token cross entropies, number of scored tokens) over the first batch, float64 sums."""
    batch = next(iter(trainer.get_train_dataloader()))
    labels = batch.pop("labels")
    with torch.no_grad():
        logits = trainer.model.eval()(**batch).logits.double()
    targets = labels[:, 1:]
    keep = targets != -100
    losses = torch.nn.functional.cross_entropy(logits[:, :-1][keep], targets[keep], reduction="none")
    return losses.sum().item(), int(keep.sum())


def test_sft_padding_free_and_packing_give_the_padded_loss(base, tmp_path):
    sums = {}
    for name, extra in {"padded": [], "padding_free": ["trainer.padding_free=true"],
                        "packing": ["trainer.packing=true"]}.items():
        cfg = _cfg("sft", base, tmp_path / name, *FAST, "data.max_calls=2", "trainer.per_device_train_batch_size=8",
                   *extra)
        torch.manual_seed(0)
        model = KDAMoEForCausalLM.from_pretrained(base, dtype=torch.float32)
        trainer = build_trainer(cfg, model, AutoTokenizer.from_pretrained(base))
        sums[name] = _token_loss_sum(trainer)
    assert sums["padded"][1] > 20  # assistant tokens of 4 episodes
    for name in ("padding_free", "packing"):
        assert sums[name][1] == sums["padded"][1], name
        assert sums[name][0] == pytest.approx(sums["padded"][0], rel=1e-5), name


# --------------------------------------------------------------------------------- GRPO with a scripted policy

_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.S)


def _assistant_text(tokenizer, message):
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "x"}, message], tokenize=False)
    return rendered.rsplit("<|im_start|>assistant\n", 1)[1].rstrip("\n")


def _script(model, tokenizer, tasks, steps_of):
    """Replace ``model.generate``: each row continues as an agent doing ``steps_of(task)`` operations (reading each
    operand from the last tool result), then submitting the value it has, then saying Done."""
    by_prompt = {t.prompt(): t for t in tasks}

    def next_message(text):
        task = next(t for p, t in by_prompt.items() if p in text)
        results = _RESPONSE.findall(text)
        if results and results[-1] == "submitted":
            return {"role": "assistant", "content": "Done."}
        current = int(results[-1]) if results else task.start
        if len(results) < steps_of(task):
            name, operand = task.ops[len(results)]
            call = {"name": name, "arguments": {"a": current, "b": operand}}
        else:
            call = {"name": "submit", "arguments": {"answer": current}}
        return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}

    def generate(input_ids, attention_mask=None, **kwargs):
        rows = []
        for ids, mask in zip(input_ids, attention_mask, strict=True):
            text = tokenizer.decode(ids[mask.bool()], skip_special_tokens=False)
            reply = _assistant_text(tokenizer, next_message(text))
            rows.append(torch.tensor(tokenizer(reply, add_special_tokens=False)["input_ids"]))
        new = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=tokenizer.pad_token_id)
        return torch.cat([input_ids, new.to(input_ids)], dim=1)

    model.generate = generate


def _grpo_trainer(cfg, base, steps_of):
    model = KDAMoEForCausalLM.from_pretrained(base, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(base)
    trainer = build_trainer(cfg, model, tokenizer)
    _script(model, tokenizer, make_tasks(cfg.data.num_tasks, cfg.data.seed, min_ops=cfg.data.min_calls,
                                         max_ops=cfg.data.max_calls, max_operand=cfg.data.max_operand), steps_of)
    return trainer, record_rewards(trainer)


def record_rewards(trainer) -> list:
    """Wrap the GRPO trainer's reward computation; the returned list fills with ``(task JSON, reward)`` pairs."""
    seen = []
    calculate = trainer._calculate_rewards

    def recording(inputs, *args):
        rewards = calculate(inputs, *args)
        seen.extend(zip([row["task"] for row in inputs], rewards[:, 0].tolist(), strict=True))
        return rewards

    trainer._calculate_rewards = recording
    return seen


def _expected_env_reward(task, steps):
    """The environment's reward rule restated (environment module docstring); chains strictly increase
    (operands >= 2), so a hasty agent never submits the answer."""
    return 1.0 if steps == task.n_ops else 0.5 * steps / task.n_ops


def test_grpo_environment_rewards_are_the_environment_rewards(base, tmp_path):
    cfg = _cfg("grpo", base, tmp_path, *RL_FAST, "data.max_calls=2", "data.num_tasks=4")

    def steps_of(task):
        return task.n_ops if task.start % 2 else task.n_ops - 1  # careful or one step short

    trainer, seen = _grpo_trainer(cfg, base, steps_of)
    trainer.train()
    assert seen

    for task_json, reward in seen:
        task = ArithmeticTask.from_json(task_json)
        assert reward == pytest.approx(_expected_env_reward(task, steps_of(task))), task
    row = trainer.state.log_history[0]
    assert row["tools/call_frequency"] > 0 and row["tools/failure_frequency"] == 0


def test_grpo_tools_executes_tool_calls(base, tmp_path):
    cfg = _cfg("grpo_tools", base, tmp_path, *RL_FAST)
    trainer, seen = _grpo_trainer(cfg, base, lambda task: task.n_ops)
    trainer.train()
    # the careful agent read each operand from the tool's result: 1.0 means the calculator tools ran
    assert seen and all(reward == 1.0 for _, reward in seen)
    row = trainer.state.log_history[0]
    assert row["tools/call_frequency"] >= 2 and row["tools/failure_frequency"] == 0


def test_grpo_tools_have_the_environment_schemas():
    assert [get_json_schema(f) for f in grpo_recipe.TOOLS] == tool_schemas(ArithmeticEnvironment)


def test_rewards_of_single_turn_and_tools_modes():
    assert grpo_recipe.stated_answer_reward([[{"role": "assistant", "content": "7 + 5 = 12"}], "it is 13", "none"],
                                            answer=[12, 12, 12]) == [1.0, 0.0, 0.0]

    def submit(v):
        return {"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "submit", "arguments": {"answer": v}}}]}

    assert grpo_recipe.submitted_answer_reward([[submit(3), submit(12)], [submit("12")], [submit(11)], []],
                                               answer=[12, 12, 12, 12]) == [1.0, 1.0, 0.0, 0.0]


# ----------------------------------------------------------------------------- DPO, RLOO, the bias callback


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("recipe, extra", [
    ("sft", []), ("dpo", []), ("rloo", ["trainer.num_generations=2", "trainer.max_completion_length=8"]),
    ("grpo_single_turn", ["trainer.num_generations=2", "trainer.max_completion_length=8"]),
])
def test_recipe_steps_move_weights_and_router_biases(base, tmp_path, recipe, extra):
    results = {}
    for biases in ("update", "freeze"):
        cfg = _cfg(recipe, base, tmp_path / biases, *FAST, "trainer.learning_rate=1e-2", f"router_biases={biases}",
                   *extra)
        model = KDAMoEForCausalLM.from_pretrained(base, dtype=torch.float32)
        before, bias_before = _params(model), _biases(model)
        trainer = build_trainer(cfg, model, AutoTokenizer.from_pretrained(base))
        add_router_bias_callback(trainer, RouterBiasUpdateCallback(freeze_biases=biases == "freeze"))
        trainer.train()
        moved = max((p - before[n]).abs().max().item() for n, p in model.named_parameters())
        results[biases] = (moved, (_biases(model) - bias_before).abs().max().item())
    if recipe in ("sft", "dpo"):  # RL steps with equal rewards in a group have zero advantage: no weight change
        assert results["update"][0] > 0
    assert results["update"][1] > 0
    assert results["freeze"][1] == 0


def test_lora_on_experts_keeps_biases_and_reloads(base, tmp_path):
    peft = json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "o_proj"],
                       "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]})
    cfg = _cfg("sft", base, tmp_path, *FAST, "trainer.learning_rate=1e-2", f"peft={peft}")
    bias_before = _biases(KDAMoEForCausalLM.from_pretrained(base, dtype=torch.float32))
    result = run_recipe(cfg)
    ids = torch.randint(10, 290, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        trained = result["model"].eval()(ids).logits
        final = AutoModelForCausalLM.from_pretrained(result["final"], trust_remote_code=True).eval()

        on_base = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), result["adapter"]).eval()
        base_logits = AutoModelForCausalLM.from_pretrained(base).eval()(ids).logits
        adapter_logits = on_base(ids).logits
        assert (trained - base_logits).abs().max() > 1e-4  # the adapter learned something
        torch.testing.assert_close(final(ids).logits, trained, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(adapter_logits, trained, atol=1e-5, rtol=1e-5)
    assert torch.equal(_biases(final), bias_before)  # frozen under PEFT
    names = [n for n, _ in on_base.named_parameters() if "lora" in n]
    assert any("experts" in n for n in names)


# ------------------------------------------------------------------------------------------ config errors


@pytest.mark.parametrize("overrides, needle", [
    (["trainer.max_stpes=2"], "max_stpes"),
    (["recipe=ppoo"], "ppoo"),
    (["grpo.mode=multi"], "multi"),
    (["router_biases=thaw"], "thaw"),
    (["trainer.output_dir=x"], "output_dir"),
    (["peft={\"rank\": 4}"], "peft"),
])
def test_config_errors_name_the_value(overrides, needle):
    with pytest.raises(ValueError, match=needle):
        load_posttrain_config("grpo", overrides)


@pytest.mark.parametrize("config, overrides, needle", [
    ("grpo_long", ["trainer.use_vllm=true"], r"trainer.use_vllm.*grpo.rollout: cached"),
    ("grpo_long", ["trainer.use_transformers_continuous_batching=true"], "use_transformers_continuous_batching"),
    ("sft", ["trainer.fsdp=true"], r"trainer.fsdp.*WORLD_SIZE is 1"),
    ("sft", ["trainer.max_steps=abc"], r"trainer.max_steps: expected an integer, got 'abc'"),
    ("sft", ["trainer.max_steps=2.5"], r"trainer.max_steps: expected an integer"),
    ("sft", ["trainer.max_steps=true"], r"trainer.max_steps: expected an integer"),
    ("dpo", ["grpo.long_context=true"], r"config field grpo: set for recipe 'dpo'"),
    ("sft", ["grpo.rollout=cached"], r"config field grpo: set for recipe 'sft'"),
])
def test_settings_that_would_fail_late_or_be_ignored_fail_when_the_config_loads(config, overrides, needle,
                                                                                   monkeypatch):
    """Each of these once failed deep inside TRL / transformers / accelerate after the model loaded (vLLM, FSDP on
    one process, a string max_steps), only at the first rollout (continuous batching), or was silently ignored (a
    grpo section on another recipe)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=needle):
        load_posttrain_config(config, overrides)


def test_fsdp_version_1_and_fsdp_under_peft_fail_when_the_config_loads(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"trainer.fsdp_config: version 1"):
        load_posttrain_config("sft", ["trainer.fsdp=true", "trainer.fsdp_config={version: 1}"])
    with pytest.raises(ValueError, match=r"trainer.fsdp: with a peft adapter"):
        load_posttrain_config("sft", ["trainer.fsdp=true", 'peft={"r": 4, "target_modules": ["q_proj"]}'])
    assert load_posttrain_config("sft", ["trainer.fsdp=true"]).trainer["fsdp"] is True


def test_unknown_trainer_key_has_a_hint():
    with pytest.raises(ValueError, match="did you mean max_steps"):
        load_posttrain_config("sft", ["trainer.max_stpes=2"])


def test_aux_loss_with_quantile_balancing_and_too_long_budget_are_refused(base, tmp_path):
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.01"):
        run_recipe(_cfg("sft", base, tmp_path, *FAST, "trainer.router_aux_loss_coef=0.01"))
    with pytest.raises(ValueError, match="max_completion_length=1000"):
        run_recipe(_cfg("grpo", base, tmp_path, *RL_FAST, "trainer.max_completion_length=1000"))


# -------------------------------------------------------------------------------------------------- CLI


def test_cli_runs_sft_then_resumes(base, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["--config", "sft", "--output-dir", str(out), "--set", f"model={base}", "--set", "data.num_tasks=4",
            "--set", "data.max_calls=1", "--set", "data.environment=arithmetic",
            "--set", "trainer.per_device_train_batch_size=2", "--set", "trainer.save_steps=1"]
    assert posttrain_main([*args, "--set", "trainer.max_steps=2"]) == 0
    assert capsys.readouterr().out.strip().endswith("final")
    first = json.loads((out / "summary.json").read_text())
    assert first["global_step"] == 2 and first["resumed_from"] is None
    assert posttrain_main([*args, "--set", "trainer.max_steps=3"]) == 0
    second = json.loads((out / "summary.json").read_text())
    assert second["global_step"] == 3 and second["resumed_from"].endswith("checkpoint-2")
    model = AutoModelForCausalLM.from_pretrained(out / "final", trust_remote_code=True)
    assert model.config.model_type == "kda_moe"
    assert model.config.use_cache is True  # the trainer's use_cache=False (for training) is not what ships
    card = (out / "final" / "README.md").read_text()
    assert "`sft`" in card and str(base) in card
    assert not list(out.glob(".final*"))  # no temporary folder left behind


def test_resume_takes_the_newest_intact_checkpoint_and_refuses_another_run(base, tmp_path, capsys, caplog):
    """Before: a checkpoint without optimizer.pt / scheduler.pt resumed with a fresh optimizer and schedule, a damaged
    newest checkpoint stopped the run with a traceback, no intact one silently started over, and another model=
    continued the old run under the new base's name."""
    out = tmp_path / "run"
    args = ["--config", "sft", "--output-dir", str(out), "--set", f"model={base}", "--set", "data.num_tasks=4",
            "--set", "data.max_calls=1", "--set", "data.environment=arithmetic",
            "--set", "trainer.per_device_train_batch_size=2", "--set", "trainer.save_steps=1"]
    assert posttrain_main([*args, "--set", "trainer.max_steps=2"]) == 0
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert all((p / "manifest.json").is_file() for p in out.glob("checkpoint-*"))

    (out / "checkpoint-2" / "optimizer.pt").unlink()
    with caplog.at_level(logging.WARNING, logger="kdamoe.posttraining.run"):
        assert posttrain_main([*args, "--set", "trainer.max_steps=3"]) == 0
    assert any(f"skipping {out / 'checkpoint-2'}: optimizer.pt is missing" in r.getMessage() for r in caplog.records)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from"].endswith("checkpoint-1") and summary["global_step"] == 3

    for checkpoint in out.glob("checkpoint-*"):  # none intact now: the newest lost its scheduler, the others' manifest
        target = checkpoint / ("scheduler.pt" if checkpoint.name == "checkpoint-3" else "manifest.json")
        target.unlink()
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        posttrain_main([*args, "--set", "trainer.max_steps=4"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "no intact checkpoint" in err and "Traceback" not in err

    other_base = tmp_path / "other_base"
    shutil.copytree(base, other_base)
    fresh = tmp_path / "run2"
    assert posttrain_main([*args[:3], str(fresh), *args[4:], "--set", "trainer.max_steps=1"]) == 0
    cfg = load_posttrain_config("sft", [f"model={other_base}", f"output_dir={fresh}", "data.num_tasks=4",
                                        "data.max_calls=1", "data.environment=arithmetic",
                                        "trainer.per_device_train_batch_size=2", "trainer.save_steps=1",
                                        "trainer.max_steps=2"])
    with pytest.raises(RunFolderError, match=f"its run used model='{base}', this one has model='{other_base}'"):
        run_recipe(cfg)


def test_an_adapter_names_its_base_by_an_absolute_path(base, tmp_path, monkeypatch):
    """Before: adapter_config.json stored the base as given (a path relative to where the run started), so the
    adapter loaded only from that folder."""
    peft = json.dumps({"r": 2, "target_modules": ["q_proj"]})
    monkeypatch.chdir(Path(base).parent)
    cfg = load_posttrain_config("sft", [f"model={Path(base).name}", f"output_dir={tmp_path / 'run'}", *FAST,
                                        f"peft={peft}"])
    result = run_recipe(cfg)
    stored = json.loads((Path(result["adapter"]) / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert stored == str(Path(base).resolve())
    monkeypatch.chdir(tmp_path)  # anywhere else
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(stored), result["adapter"])
    # Before: the adapter's README.md was PEFT's empty template. Now a card: the base by its absolute path, with a
    # note, the recipe, and usage code that loads this adapter onto that base.
    card = ModelCard.load(Path(result["adapter"]) / "README.md")
    assert card.data.library_name == "peft" and card.data.base_model_relation == "adapter"
    assert "More Information Needed" not in card.text and "`sft`" in card.text
    assert f"in the local folder `{stored}` (not on the Hub" in card.text
    assert f'AutoModelForCausalLM.from_pretrained("{stored}", trust_remote_code=True)' in card.text
    assert f'PeftModel.from_pretrained(base, "{Path(result["adapter"]).resolve()}")' in card.text
    # kdamoe-push --adapter keeps the run's recipe and data, adds the LoRA settings, and names the base by its id
    pushed = ModelCard.load(hub.build_hub_folder(result["adapter"], tmp_path / "hub", merge_adapter=False,
                                                 base_model="me/base", validate=False) / "README.md")
    assert pushed.data.base_model == "me/base"
    assert "`sft` with TRL's `SFTTrainer` and a LoRA adapter, from" in pushed.text
    assert "LoRA (PEFT) with rank 2" in pushed.text and "Data: 4 generated chained-arithmetic tasks" in pushed.text


def test_card_renders_the_reward_curve():
    card = str(render_model_card(tiny_config(), repo_id="kdamoe/x", total=10, active=5, recipe="`grpo` (environment)",
                                 base_model_path="outputs/base", reward_curve=[(1, 0.25), (2, 0.5)],
                                 reward_curve_image="reward_curve.png"))
    assert "| 1 | 0.2500 |\n| 2 | 0.5000 |" in card and "](reward_curve.png)" in card
    assert "Recipe: `grpo` (environment), from the base model `outputs/base`." in card
    assert "mean reward" not in str(render_model_card(tiny_config(), repo_id="kdamoe/x", total=10, active=5))
    with pytest.raises(ValueError, match="nan"):
        render_model_card(tiny_config(), repo_id="kdamoe/x", total=10, active=5, reward_curve=[(1, float("nan"))])


def _section(card: str, title: str) -> str:
    start = card.index(f"## {title}\n")
    return card[start:card.index("\n## ", start + 1)]


def test_sft_card_shows_the_loss_and_a_push_keeps_the_training_section(base, tmp_path, monkeypatch):
    """Before: an SFT card had no metric, its usage code loaded a guessed ``kdamoe/<name>`` id with a "ROMEO." prompt,
    and ``kdamoe-push`` of ``final/`` rebuilt a card whose Training section was empty (also with --base-model)."""
    cfg = _cfg("sft", base, tmp_path, *FAST, "trainer.max_steps=3", "trainer.logging_steps=1")
    result = run_recipe(cfg)
    final = Path(result["final"])
    logged = [(row["step"], row["loss"]) for row in result["log_history"] if "loss" in row]
    assert [s for s, _ in logged] == [1, 2, 3]
    card = (final / "README.md").read_text()
    table = "| step | training loss |\n|---|---|\n" + "".join(f"| {s} | {v:.4f} |\n" for s, v in logged)
    assert table in card and "](loss_curve.png)" in card and (final / "loss_curve.png").is_file()
    assert "ROMEO" not in card and 'from_pretrained("kdamoe/' not in card
    assert "tools = [" in card and '"name": "add"' in card  # an arithmetic agent: a chat with its calculator tools

    # the card's usage code runs from another folder (it names final/ by its absolute path) and generates
    code = card.split("```python\n")[1].split("```")[0].replace("max_new_tokens=60", "max_new_tokens=2")
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(code, "card-usage", "exec"), namespace)
    assert namespace["out"].shape[1] == namespace["inputs"]["input_ids"].shape[1] + 2

    for kwargs in ({}, {"base_model": "me/kdamoe-base", "repo_id": "me/kdamoe-sft"}):
        pushed = hub.build_hub_folder(final, tmp_path / f"hub{len(kwargs)}", validate=False, **kwargs)
        pushed_card = (pushed / "README.md").read_text()
        assert _section(pushed_card, "Training") == _section(card, "Training")
        assert (pushed / "loss_curve.png").read_bytes() == (final / "loss_curve.png").read_bytes()
    assert ModelCard.load(pushed / "README.md").data.base_model == "me/kdamoe-base"
    assert 'from_pretrained("me/kdamoe-sft", trust_remote_code=True)' in pushed_card


def test_card_values_say_what_each_mode_ran():
    """Before: the grpo_single_turn and rloo cards claimed "calculator tools, 1-2 tool calls" for modes without
    tools, the grpo_long card did not name its cached rollouts and memory-bounded update, and every card's usage
    prompted "ROMEO."."""
    for name in ("grpo_single_turn", "rloo"):
        values = card_values(load_posttrain_config(name), [])
        text = values["recipe"] + " " + values["training_description"]
        assert "calculator" not in text and "tool call" not in text and "without tools" in text
        assert values["usage"]["tools"] is None and values["usage"]["prompt"].endswith("Submit the result.")
    long = card_values(load_posttrain_config("grpo_long"), [])
    assert "cached rollouts" in long["recipe"] and "memory-bounded update" in long["recipe"]
    assert [t["function"]["name"] for t in long["usage"]["tools"]] == ["open_door", "take_key"]
    history = [{"step": 1, "loss": 2.0}, {"step": 1, "reward": 0.5}, {"step": 1, "train_loss": 2.0}]
    assert card_values(load_posttrain_config("dpo"), history)["loss_curve"] == [(1, 2.0)]
    assert card_values(load_posttrain_config("dpo"), history)["reward_curve"] is None
    assert card_values(load_posttrain_config("rloo"), history)["reward_curve"] == [(1, 0.5)]
    only_mean = card_values(load_posttrain_config("sft"), [{"step": 5, "train_loss": 1.25}])
    assert not only_mean["loss_curve"] and "Mean training loss over the run 1.2500" in only_mean["training_description"]


def test_a_constant_curve_is_drawn_flat_and_called_constant(tmp_path):
    """Before: a reward that stayed at 1.0 up to float32 rounding was autoscaled to a ~1e-7 range and drawn as a
    falling curve."""
    curve = [(1, 1.0), (2, 0.99999994), (3, 1.0)]
    bottom, top = plot_curve(curve, tmp_path / "reward_curve.png", "mean reward")
    assert bottom <= 0.5 and top >= 1.5
    card = str(render_model_card(tiny_config(), repo_id="me/x", total=10, active=5, reward_curve=curve))
    assert "constant at 1.0000 over 3 logged steps (1 to 3)" in card
    bottom, top = plot_curve([(1, 0.25), (2, 0.5)], tmp_path / "moving.png", "mean reward")
    assert top - bottom < 0.5  # a moving curve keeps matplotlib's own range
    assert "constant" not in str(render_model_card(tiny_config(), repo_id="me/x", total=10, active=5,
                                                   reward_curve=[(1, 0.25), (2, 0.5)]))


def test_a_missing_base_folder_is_named(tmp_path):
    # Before: the shipped grpo config without a prior sft run ended in huggingface_hub's HFValidationError traceback.
    cfg = load_posttrain_config("grpo", [f"model={tmp_path / 'outputs' / 'posttrain' / 'sft' / 'final'}",
                                         f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(ValueError, match="no model folder there.*kdamoe-posttrain --config sft"):
        run_recipe(cfg)


def test_cli_keeps_a_library_errors_traceback_and_turns_ours_into_a_usage_error(monkeypatch, capsys):
    """``kdamoe-posttrain``: a ValueError raised by kdamoe's own checks is a usage error (one line, exit 2); one raised
    inside a library (here json's) propagates with its traceback, which once was hidden and made a deep crash look
    like a config error."""
    monkeypatch.setattr(kdamoe.posttraining, "run_recipe", lambda cfg, **kw: json_module.loads("not json"))
    with pytest.raises(json_module.JSONDecodeError):
        posttrain_main(["--config", "sft"])
    monkeypatch.setattr(kdamoe.posttraining, "run_recipe", lambda cfg, **kw: real_token_span(torch.zeros(3)))
    with pytest.raises(SystemExit) as exit_info:
        posttrain_main(["--config", "sft"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "kdamoe-posttrain: error: attention_mask: a row without any real token" in err


def test_checkpointing_uses_the_current_names_and_keeps_a_users_old_name(tmp_path):
    """The recipes set ``activation_checkpointing`` (transformers 5.24's name; the old ``gradient_checkpointing``
    warned on every run); a user's old-name setting is renamed, not silently beaten by a default under the new name
    (given both, the new one wins inside TrainingArguments), and both names at once are refused."""
    cfg = load_posttrain_config("sft", [f"output_dir={tmp_path}"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = trainer_args(cfg, SFTConfig)
    assert not [w for w in caught if "gradient_checkpointing" in str(w.message)]
    assert args.activation_checkpointing is (torch.cuda.is_available() or False)
    cfg = load_posttrain_config("sft", [f"output_dir={tmp_path}", "trainer.gradient_checkpointing=true"])
    assert trainer_args(cfg, SFTConfig).activation_checkpointing is True
    cfg = load_posttrain_config("sft", [f"output_dir={tmp_path}", "trainer.gradient_checkpointing=true",
                                        "trainer.activation_checkpointing=false"])
    with pytest.raises(ValueError, match="trainer.gradient_checkpointing: give one of"):
        trainer_args(cfg, SFTConfig)
