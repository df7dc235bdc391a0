"""PEFT LoRA reaches attention projections and the fused 3-D expert weights (``target_parameters``)."""

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


def test_lora_adapter_on_a_fresh_base_reproduces_the_trained_model(tmp_path, caplog):
    """Router biases are frozen under PEFT: the adapter alone (no buffers) must rebuild the trained model."""
    torch.manual_seed(0)
    base = KDAMoEForCausalLM(tiny_config())
    base.save_pretrained(tmp_path / "base")  # the published base
    peft_model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    callback = RouterBiasUpdateCallback(warn_threshold=100.0)
    gen = torch.Generator().manual_seed(1)
    peft_model.train()
    with caplog.at_level("WARNING", logger="kdamoe.callbacks"):
        for step in range(3):
            ids = torch.randint(3, 97, (2, 16), generator=gen)
            peft_model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            callback.on_step_end(None, TrainerState(global_step=step + 1), TrainerControl(), model=peft_model)
            assert float(base.expert_load().sum()) == 0  # statistics reset although nothing moved
    assert len(callback.history) == 3  # expert load still reported
    assert sum("stay frozen" in r.getMessage() for r in caplog.records) == 1  # said once, with the reason
    assert all(torch.count_nonzero(r.e_score_correction_bias) == 0 for r in base._routers())
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
