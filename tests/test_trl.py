"""TRL GRPO drives the model as-is: left-padded prompts, sampled completions, router-bias callback."""

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

from kdamoe import KDAMoEForCausalLM
from kdamoe.callbacks import RouterBiasUpdateCallback
from tests.helpers import tiny_config


def _letter_tokenizer():
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: 3 + i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz")}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def test_grpo_steps_update_weights_and_router_biases(tmp_path):
    torch.manual_seed(0)
    model = KDAMoEForCausalLM(tiny_config(vocab_size=29))
    weights_before = model.lm_head.weight.detach().clone()
    biases_before = [r.e_score_correction_bias.clone() for r in model._routers()]
    # uneven lengths: left padding
    prompts = Dataset.from_dict({"prompt": ["a b c", "d e f g h", "x y", "p q r s"] * 2})

    def reward(completions, **kwargs):
        return [float(c.count("a")) + 0.1 * len(c) for c in completions]

    args = GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
        max_steps=2, learning_rate=1e-3, report_to=[], logging_steps=1, save_strategy="no", use_cpu=True, seed=0,
    )
    callback = RouterBiasUpdateCallback(warn_threshold=100.0)
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=args, train_dataset=prompts,
        processing_class=_letter_tokenizer(), callbacks=[callback],
    )
    trainer.train()
    assert trainer.state.global_step == 2
    assert not torch.equal(weights_before, model.lm_head.weight)
    assert all(not torch.equal(b, r.e_score_correction_bias)
               for b, r in zip(biases_before, model._routers(), strict=True))
    assert len(callback.history) == 2 and len(callback.history[0]) == model.config.num_sparse_layers
    assert all(value >= 1.0 for step in callback.history for value in step)
