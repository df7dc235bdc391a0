"""Recipe ``ppo`` (TRL 1.12's PPOTrainer): runs in the PPO venv (``make test-ppo``), skipped elsewhere.

Two PPO updates with a tiny KDAMoE policy whose reward model the recipe first trains on the preference
pairs and whose value model starts from that reward model.
"""

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("trl.experimental.ppo", reason="TRL's PPO trainer needs trl==1.12 (make ppo-env)")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from kdamoe import KDAMoEForCausalLM, KDAMoEForSequenceClassification  # noqa: E402
from kdamoe.callbacks import add_router_bias_callback  # noqa: E402
from kdamoe.posttraining.data import episode_messages, user_message  # noqa: E402
from kdamoe.posttraining.environment import make_tasks  # noqa: E402
from kdamoe.posttraining.recipes.ppo import PPOSection, build_trainer  # noqa: E402
from kdamoe.training.tokenizer import train_tokenizer  # noqa: E402
from tests.helpers import tiny_config  # noqa: E402


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
        eos_token_id=tokenizer.eos_token_id,
    ))
    folder = tmp_path_factory.mktemp("base")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, tokenizer


def test_ppo_moves_policy_and_value_not_reward_or_reference(base_folder, tmp_path):
    folder, tokenizer = base_folder
    cfg = SimpleNamespace(
        recipe="ppo", model=str(folder), output_dir=str(tmp_path / "run"), seed=0, router_biases="update",
        data=SimpleNamespace(environment="arithmetic", num_tasks=4, seed=0, min_calls=1, max_calls=1, max_operand=9),
        trainer=dict(per_device_train_batch_size=2, max_steps=2, num_ppo_epochs=1, response_length=8,
                     learning_rate=1e-3, save_strategy="no", local_rollout_forward_batch_size=2),
        ppo=PPOSection(reward_steps=2, reward_batch_size=2, reward_learning_rate=1e-3),
    )
    policy = KDAMoEForCausalLM.from_pretrained(folder)
    base_biases = [b.clone() for b in _biases(policy)]
    policy_before = _state(policy)
    trainer = build_trainer(cfg, policy, tokenizer)

    # The reward model was trained (weights and, via the callback, router biases moved) and saved.
    saved_reward = KDAMoEForSequenceClassification.from_pretrained(tmp_path / "run" / "reward_model")
    assert all(not torch.equal(a, b) for a, b in zip(base_biases, _biases(saved_reward)))
    value, reward, ref = trainer.value_model, trainer.reward_model, trainer.ref_model
    assert isinstance(value, KDAMoEForSequenceClassification) and isinstance(reward, KDAMoEForSequenceClassification)
    assert torch.equal(value.score.weight, saved_reward.score.weight)  # the value model starts from the reward model
    value_before, reward_before, ref_before = _state(value), _state(reward), _state(ref)

    callback = add_router_bias_callback(trainer)
    trainer.train()
    assert trainer.state.global_step == 2
    assert len(callback.history) == 2

    after = _state(policy)
    assert not torch.equal(policy_before["lm_head.weight"], after["lm_head.weight"])
    assert all(not torch.equal(a, b) for a, b in zip(base_biases, _biases(policy)))
    after = _state(value)
    assert not torch.equal(value_before["score.weight"], after["score.weight"])
    assert not torch.equal(value_before["model.embed_tokens.weight"], after["model.embed_tokens.weight"])
    assert all(not torch.equal(value_before[f"bias{i}"], b) for i, b in enumerate(_biases(value)))
    logged = [row for row in trainer.state.log_history if "expert_load/value_model/max_over_mean" in row]
    assert len(logged) == 2  # the value model's load is reported every update
    for before, model in ((reward_before, reward), (ref_before, ref)):
        now = _state(model)
        assert now.keys() == before.keys() and all(torch.equal(before[k], now[k]) for k in before)

    out = tmp_path / "final"
    trainer.save_model(str(out))
    reloaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert (out / "modeling_kdamoe.py").is_file() and not (out / "value_model").exists()  # remote code, policy only
    ids = torch.tensor([tokenizer.encode("<|im_start|>user\nStart with 3, add 4.<|im_end|>\n")])
    policy.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, policy(ids).logits, rtol=0, atol=0)
