"""Recipe ``ppo`` (TRL 1.12's PPOTrainer): runs in the PPO venv (``make test-ppo``), skipped elsewhere.

Two PPO updates with a tiny KDAMoE policy whose reward model the recipe first trains on the preference
pairs and whose value model starts from that reward model, run the way ``kdamoe-posttrain --config ppo``
runs it (the shipped YAML through ``load_posttrain_config``, then ``run_recipe``).
"""

import json
from pathlib import Path

import pytest

pytest.importorskip("trl.experimental.ppo", reason="TRL's PPO trainer needs trl==1.12 (make ppo-env)")

import torch  # noqa: E402 (imported after the importorskip above: outside the PPO venv the module is skipped)
from transformers import AutoModelForCausalLM  # noqa: E402 (imported after the importorskip above: outside the PPO venv the module is skipped)

from kdamoe import KDAMoEForCausalLM, KDAMoEForSequenceClassification  # noqa: E402 (imported after the importorskip above: outside the PPO venv the module is skipped)
from kdamoe.posttraining import load_posttrain_config, run_recipe  # noqa: E402 (imported after the importorskip above: outside the PPO venv the module is skipped)
from kdamoe.posttraining.data import episode_messages, user_message  # noqa: E402 (imported after the importorskip above: outside the PPO venv the module is skipped)
from kdamoe.posttraining.environments.arithmetic import make_tasks  # noqa: E402 (imported after the importorskip above: outside the PPO venv the module is skipped)
from kdamoe.training.tokenizer import train_tokenizer  # noqa: E402 (imported after the importorskip above: outside the PPO venv the module is skipped)
from tests.helpers import tiny_config  # noqa: E402 (imported after the importorskip above: outside the PPO venv the module is skipped)


def _state(model) -> dict[str, torch.Tensor]:
    """Every parameter and router bias, copied."""
    out = {name: p.detach().clone() for name, p in model.named_parameters()}
    out.update({f"bias{i}": r.e_score_correction_bias.clone() for i, r in enumerate(model._routers())})
    return out


def _biases(model) -> list[torch.Tensor]:
    return [r.e_score_correction_bias for r in model._routers()]


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory):
    """A tiny random KDAMoE causal LM with a chat tokenizer trained on episode text, saved as a model folder."""
    tasks = make_tasks(8, seed=1, min_ops=1, max_ops=1)
    texts = [json.dumps([user_message(t), *episode_messages(t)]) for t in tasks]
    tokenizer = train_tokenizer(texts * 4, vocab_size=300, min_frequency=1)
    torch.manual_seed(0)
    model = KDAMoEForCausalLM(tiny_config(
        vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, kda_head_dim=16,  # final/ reloads with kernel_backend="auto"
    ))
    folder = tmp_path_factory.mktemp("base")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, tokenizer


def test_ppo_moves_policy_and_value_not_reward_or_reference(base_folder, tmp_path):
    """Through the CLI's path: the shipped ppo.yaml, run_recipe (callback attached first), final/ + card."""
    folder, tokenizer = base_folder
    out = tmp_path / "run"
    cfg = load_posttrain_config("ppo", [
        f"model={folder}", f"output_dir={out}", "data.environment=arithmetic", "data.num_tasks=4",
        "data.max_calls=1", "trainer.per_device_train_batch_size=2", "trainer.max_steps=2",
        "trainer.num_ppo_epochs=1", "trainer.response_length=8", "trainer.learning_rate=1e-3",
        "trainer.save_strategy='no'", "trainer.local_rollout_forward_batch_size=2", "ppo.reward_steps=2",
        "ppo.reward_batch_size=2", "ppo.reward_learning_rate=1e-3"])
    base = KDAMoEForCausalLM.from_pretrained(folder)
    base_state = _state(base)

    result = run_recipe(cfg, resume=False)
    trainer, policy = result["trainer"], result["model"]
    assert trainer.state.global_step == 2 and isinstance(policy, KDAMoEForCausalLM)

    # The reward model was trained first (weights and, via the callback, router biases moved) and saved.
    saved_reward = KDAMoEForSequenceClassification.from_pretrained(out / "reward_model")
    reward_state = _state(saved_reward)
    assert all(not torch.equal(base_state[f"bias{i}"], b) for i, b in enumerate(_biases(saved_reward)))
    value, reward, ref = trainer.value_model, trainer.reward_model, trainer.ref_model
    assert isinstance(value, KDAMoEForSequenceClassification) and isinstance(reward, KDAMoEForSequenceClassification)

    # Policy and value model (which started from the reward model) trained and balanced ...
    after = _state(policy)
    assert not torch.equal(base_state["lm_head.weight"], after["lm_head.weight"])
    assert all(not torch.equal(base_state[f"bias{i}"], b) for i, b in enumerate(_biases(policy)))
    after = _state(value)
    assert not torch.equal(reward_state["score.weight"], after["score.weight"])
    assert not torch.equal(reward_state["model.embed_tokens.weight"], after["model.embed_tokens.weight"])
    assert all(not torch.equal(reward_state[f"bias{i}"], b) for i, b in enumerate(_biases(value)))
    logged = [row for row in trainer.state.log_history if "expert_load/value_model/max_over_mean" in row]
    assert len(logged) == 2  # the value model's load is reported every update
    # ... the frozen reward and reference models never moved.
    for before, model in ((reward_state, reward), (base_state, ref)):
        now = _state(model)
        assert now.keys() == before.keys() and all(torch.equal(before[k], now[k]) for k in before)

    final = Path(result["final"])
    reloaded = AutoModelForCausalLM.from_pretrained(final, trust_remote_code=True)
    assert (final / "modeling_kdamoe.py").is_file() and not (final / "value_model").exists()  # remote code, policy only
    assert "mean reward" in (final / "README.md").read_text()  # the card's reward curve (PPO's objective/scores)
    ids = torch.tensor([tokenizer.encode("<|im_start|>user\nStart with 3, add 4.<|im_end|>\n")])
    policy.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, policy(ids).logits, rtol=0, atol=0)
