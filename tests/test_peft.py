"""PEFT LoRA reaches attention projections and the fused 3-D expert weights (``target_parameters``)."""

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import TrainerControl, TrainerState

from kdamoe import KDAMoEForCausalLM
from kdamoe.callbacks import RouterBiasUpdateCallback
from tests.helpers import tiny_config


def test_lora_on_attention_and_experts_trains_and_merges():
    torch.manual_seed(0)
    model = KDAMoEForCausalLM(tiny_config())
    ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    base = model(ids, use_cache=False).logits.detach()
    config = LoraConfig(
        r=4,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "kv_b_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    peft_model = get_peft_model(model, config)
    out = peft_model(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.logits, base)  # LoRA B starts at zero
    out.loss.backward()
    expert_lora = [p for n, p in peft_model.named_parameters() if "experts" in n and "lora_B" in n]
    assert expert_lora and all(float(p.grad.abs().sum()) > 0 for p in expert_lora)
    with torch.no_grad():  # move away from the identity, then merging must keep the function
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
        adapted = peft_model(input_ids=ids).logits
        merged = peft_model.merge_and_unload()
        torch.testing.assert_close(merged(ids, use_cache=False).logits, adapted, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(adapted, base)


@pytest.mark.parametrize("rule", ["callback", "direct_call"])
def test_lora_adapter_on_a_fresh_base_reproduces_the_trained_model(tmp_path, caplog, rule):
    """Router biases are frozen under PEFT: the adapter alone (no buffers) must rebuild the trained model.

    One rule whoever applies it: the Trainer callback, or a hand-written loop calling ``update_router_biases()``
    on the PEFT-wrapped model (PEFT forwards the call to the base, whose router weights are frozen)."""
    torch.manual_seed(0)
    base = KDAMoEForCausalLM(tiny_config())
    assert base.config.router_bias_update != "none"  # else nothing would move in any case
    base.save_pretrained(tmp_path / "base")  # the published base
    peft_model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    callback = RouterBiasUpdateCallback(warn_threshold=100.0)
    gen = torch.Generator().manual_seed(1)
    peft_model.train()
    with caplog.at_level("WARNING"):
        for step in range(3):
            ids = torch.randint(3, 97, (2, 16), generator=gen)
            peft_model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            assert float(base.expert_load().sum()) > 0  # the step counted tokens
            if rule == "callback":
                callback.on_step_end(None, TrainerState(global_step=step + 1), TrainerControl(), model=peft_model)
            else:
                peft_model.update_router_biases()
            assert float(base.expert_load().sum()) == 0  # statistics reset although nothing moved
    if rule == "callback":
        assert len(callback.history) == 3  # expert load still reported
    assert all(torch.count_nonzero(r.e_score_correction_bias) == 0 for r in base._routers())  # biases unmoved
    frozen_warnings = [r for r in caplog.records if r.levelname == "WARNING" and "frozen" in r.getMessage()]
    assert len(frozen_warnings) == 1  # said once, with the reason
    peft_model.save_pretrained(tmp_path / "adapter")

    ids = torch.randint(3, 97, (2, 24), generator=gen)
    peft_model.eval()
    with torch.no_grad():
        trained = peft_model(input_ids=ids).logits
        fresh = PeftModel.from_pretrained(KDAMoEForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
        reloaded = fresh.eval()(input_ids=ids).logits
        untrained = KDAMoEForCausalLM.from_pretrained(tmp_path / "base").eval()(ids, use_cache=False).logits
    assert not torch.allclose(trained, untrained, atol=1e-3)  # the adapter learned something
    torch.testing.assert_close(reloaded, trained, rtol=1e-6, atol=1e-6)


def test_update_router_biases_still_moves_trainable_routers():
    """The frozen-router rule must not stop full fine-tuning: with trainable routers the biases move."""
    torch.manual_seed(0)
    model = KDAMoEForCausalLM(tiny_config()).train()
    ids = torch.randint(3, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    model.update_router_biases()
    assert any(torch.count_nonzero(r.e_score_correction_bias) > 0 for r in model._routers())
    assert float(model.expert_load().sum()) == 0
