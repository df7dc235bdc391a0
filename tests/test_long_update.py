"""The memory-bounded GRPO update (issue #16; docs/post-training.md, "Long-horizon agentic RL").

TRL 1.16's ``GRPOTrainer`` patches the policy and the reference model with ``add_fused_lm_head``: the forward runs
our backbone (``KDAMoEForCausalLM.model``), then ``trl.kernels.ChunkedLogProbFunction`` projects the hidden states
through the LM head tile by tile (token tiles x vocabulary tiles), folding each tile into online-logsumexp
statistics, and its backward recomputes each tile. With activation checkpointing per decoder layer and our chunked
prefill for the no-grad passes (reference and old-policy log-probs), nothing of size ``[T, vocab]`` is ever
allocated; ``LongContextGRPOTrainer`` scores each row without its padding, so neither is a ``[T, T]`` mask. These tests
run that path with small tiles (the TRL module constants patched, so a short sequence spans several tiles and chunks)
and compare it with an independent reference: the model's own full-logits forward in one pass, no checkpointing,
``log_softmax`` in float32, and the GRPO loss (Shao et al. 2024, arXiv:2402.03300; the ``bnpo`` aggregation with the k3
KL estimator and an entropy bonus) written out here.
"""

import pytest
import torch
import trl.kernels.chunked_logprob as trl_chunked_logprob
import trl.trainer.utils as trl_utils
from datasets import Dataset
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from kdamoe import KDAMoEForCausalLM
from kdamoe.model.modeling_kdamoe import KDAMoEModel
from kdamoe.posttraining.long_update import LongContextGRPOTrainer, real_token_span
from kdamoe.posttraining.recipes import build_trainer
from kdamoe.posttraining.rollout import CachedRolloutGRPOTrainer
from tests.helpers import tiny_config
from tests.test_posttrain import RL_FAST, _cfg, base  # noqa: F401  (the tiny base folder fixture)
from tests.test_trl import _letter_tokenizer

VOCAB = 131  # no model width equals it, so a tensor with a dimension of 131 is vocabulary-sized
PREFILL_CHUNK = 16  # the no-grad passes' chunk of tokens per row (model config)
TOKEN_TILE, VOCAB_TILE = 24, 48  # TRL's head tiles (defaults 4096 tokens x 32768 vocabulary columns)
TEMPERATURE = 0.7
RTOL = 1e-5


@pytest.fixture
def small_tiles(monkeypatch):
    """TRL's head tiles shrunk so the test's few hundred tokens and 131-token vocabulary span several of each (both
    constants are module globals read on every call)."""
    monkeypatch.setattr(trl_chunked_logprob, "TOKEN_CHUNK_SIZE", TOKEN_TILE)
    monkeypatch.setattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", VOCAB_TILE)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny float32 KDAMoE (3 KDA + 1 MLA layers, Block AttnRes, MoE) saved where TRL can load its reference."""
    path = tmp_path_factory.mktemp("long_update_base")
    torch.manual_seed(0)
    KDAMoEForCausalLM(tiny_config(vocab_size=VOCAB, prefill_chunk_size=PREFILL_CHUNK)).save_pretrained(path)
    return str(path)


def _load(folder):
    return KDAMoEForCausalLM.from_pretrained(folder, dtype=torch.float32)


def _perturb(models, seed, scale=0.02):
    """The same seeded noise on every parameter of each of ``models`` (stands in for optimizer steps)."""
    for model in models:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(scale * torch.randn(p.shape, generator=generator))


def _trainer(folder, tmp_path, trainer_class=LongContextGRPOTrainer, **overrides) -> GRPOTrainer:
    kwargs = dict(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2,
                  max_completion_length=48, beta=0.1, entropy_coef=0.05, loss_type="bnpo", temperature=TEMPERATURE,
                  activation_checkpointing=True, use_cpu=True, bf16=False, report_to=[], save_strategy="no")
    kwargs.update(overrides)
    trainer = trainer_class(model=_load(folder), args=GRPOConfig(**kwargs),
                          reward_funcs=lambda completions, **_: [0.0] * len(completions),
                          train_dataset=Dataset.from_dict({"prompt": ["a b"] * 4}),
                          processing_class=_letter_tokenizer())
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(); one micro-batch per step here
    return trainer


def _rollouts(seed, rows=2, prompt=20, completion=48):
    """GRPO's layout: left-padded prompts, right-padded completions, random ids from a fixed seed."""
    generator = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, VOCAB, (rows, prompt), generator=generator)
    completion_ids = torch.randint(3, VOCAB, (rows, completion), generator=generator)
    prompt_mask = torch.ones(rows, prompt, dtype=torch.long)
    prompt_mask[-1, : prompt // 3] = 0  # the last row: a shorter prompt, left padding
    completion_mask = torch.ones(rows, completion, dtype=torch.long)
    completion_mask[0, -completion // 4:] = 0  # the first row: a shorter completion, right padding
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                completion_mask=completion_mask)


def _full_logits_reference(model, batch):
    """(log-prob of each completion token, entropy of each completion position), both ``[B, C]`` float32, from the
    model's plain forward: one pass (no chunking, no checkpointing), the full ``[B, T, V]`` logits at the sampling
    temperature, ``log_softmax``."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    c = batch["completion_ids"].shape[1]
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                   prefill_chunk_size=0).logits.float()
    logp = (logits[:, :-1] / TEMPERATURE).log_softmax(-1)[:, -c:]
    token_logp = logp.gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return token_logp, entropy


def _trl_pass(trainer, model, batch, compute_entropy=True):
    """TRL's own per-token pass (``_get_per_token_logps_and_entropies``, the fused LM head)."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    logps, entropy, _ = trainer._get_per_token_logps_and_entropies(
        model, input_ids, attention_mask, batch["completion_ids"].shape[1], compute_entropy=compute_entropy)
    return logps, entropy


def _close(actual, expected, mask=None):
    """Max |actual - expected| relative to max |expected| (over ``mask`` where given)."""
    if mask is not None:
        actual, expected = actual[mask.bool()], expected[mask.bool()]
    return ((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-30)).item()


class _CountChunks:
    """Counts the backbone's passes over token chunks (``KDAMoEModel._forward_tokens`` calls)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        original = KDAMoEModel._forward_tokens

        def counting(model, *args, **kwargs):
            self.calls += 1
            return original(model, *args, **kwargs)

        monkeypatch.setattr(KDAMoEModel, "_forward_tokens", counting)


def test_no_grad_reference_and_old_policy_passes_equal_the_single_pass(folder, tmp_path, small_tiles, monkeypatch):
    """The reference-model and old-policy log-probs (TRL's no-grad passes through the fused head) run our chunked
    prefill and the tiled head, and equal the full-logits single pass; entropies too."""
    trainer = _trainer(folder, tmp_path)
    policy, ref = trainer.model, trainer.ref_model
    _perturb([policy], seed=1)  # the policy has moved away from the reference
    batch = _rollouts(seed=2)
    mask = batch["completion_mask"]
    lengths = torch.cat([batch["prompt_mask"], mask], 1).sum(1).tolist()
    want_chunks = sum(-(-n // PREFILL_CHUNK) for n in lengths)
    assert want_chunks >= 2 * len(lengths)
    chunks = _CountChunks(monkeypatch)
    with torch.no_grad():
        for model in (ref, policy):
            # TRL's reference head computes log-probs only; the policy's also entropies
            logps, entropy = _trl_pass(trainer, model, batch, compute_entropy=model is policy)
            # each row without its padding, in chunks of PREFILL_CHUNK tokens
            assert chunks.calls == want_chunks, chunks.calls
            chunks.calls = 0
            want_logps, want_entropy = _full_logits_reference(model, batch)
            assert _close(logps, want_logps, mask) < RTOL
            if model is policy:
                assert _close(entropy, want_entropy, mask) < RTOL
            model.config.prefill_chunk_size = 0  # the same TRL pass in one backbone pass
            chunks.calls = 0
            one_pass, _ = _trl_pass(trainer, model, batch, compute_entropy=False)
            model.config.prefill_chunk_size = PREFILL_CHUNK
            assert chunks.calls == len(lengths)
            chunks.calls = 0
            assert _close(logps, one_pass, mask) < RTOL
        # the KL's two inputs really differ (else the KL test below would compare zeros)
        assert (_trl_pass(trainer, ref, batch, compute_entropy=False)[0] - logps).abs().max() > 1e-3


def _reference_grpo_loss(trainer, logps, entropy, old_logps, ref_logps, advantages, mask):
    """GRPO's clipped surrogate + beta x k3 KL (times the importance ratio, TRL's ``use_bias_correction_kl``),
    ``bnpo`` aggregation (token mean over the batch), minus the entropy bonus (token mean); one micro-batch, no
    gradient accumulation."""
    ratio = torch.exp(logps - old_logps)
    clipped = ratio.clamp(1 - trainer.epsilon_low, 1 + trainer.epsilon_high)
    a = advantages.unsqueeze(1)
    per_token = -torch.minimum(ratio * a, clipped * a)
    kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
    if trainer.args.use_bias_correction_kl:  # TRL's default: the KL of tokens sampled from the old policy, reweighted
        kl = kl * ratio
    per_token = per_token + trainer.beta * kl
    mask = mask.float()
    return (per_token * mask).sum() / mask.sum() - trainer.entropy_coef * (entropy * mask).sum() / mask.sum()


@pytest.mark.parametrize("trainer_class", [LongContextGRPOTrainer, GRPOTrainer])
def test_memory_bounded_grpo_loss_and_gradients_equal_the_unchunked_reference(folder, tmp_path, small_tiles,
                                                                              trainer_class):
    """TRL's GRPO loss through the fused head with per-layer activation checkpointing (the training forward), and
    every parameter gradient, equal the unchunked, uncheckpointed full-logits reference within 1e-5 relative; with
    the rows scored unpadded (LongContextGRPOTrainer) and padded (TRL's own pass)."""
    trainer = _trainer(folder, tmp_path, trainer_class=trainer_class)
    policy, ref = trainer.model, trainer.ref_model
    reference = _load(folder)  # an untouched copy: no fused head, no checkpointing
    _perturb([policy, reference], seed=1)
    batch = _rollouts(seed=3)
    mask = batch["completion_mask"]
    with torch.no_grad():
        ref_logps, _ = _trl_pass(trainer, ref, batch, compute_entropy=False)
        old_logps, _ = _trl_pass(trainer, policy, batch, compute_entropy=False)
    _perturb([policy, reference], seed=4, scale=0.01)  # an optimizer step since the rollouts: ratios != 1
    advantages = torch.tensor([1.3, -0.7])
    inputs = dict(batch, advantages=advantages, old_per_token_logps=old_logps, ref_per_token_logps=ref_logps,
                  num_items_in_batch=mask.sum())

    policy.activation_checkpointing_enable()  # what Trainer.train() does with activation_checkpointing=True
    policy.train()
    reference.train()
    assert all(layer.gradient_checkpointing for layer in policy.model.layers)
    recomputed = []  # the token mixers run twice per layer: forward, and again in the backward
    hooks = [layer.self_attn.register_forward_hook(lambda *_: recomputed.append(1)) for layer in policy.model.layers]
    loss = trainer._compute_loss(policy, inputs)
    loss.backward()
    for hook in hooks:
        hook.remove()
    forwards = len(advantages) if trainer_class is LongContextGRPOTrainer else 1  # one per row, or the batch
    assert len(recomputed) == 2 * len(policy.model.layers) * forwards

    logps, entropy = _full_logits_reference(reference, batch)
    want = _reference_grpo_loss(trainer, logps, entropy, old_logps, ref_logps, advantages, mask)
    want.backward()
    clipped = (torch.exp(logps - old_logps) - 1).abs() > trainer.epsilon_low
    assert clipped[mask.bool()].any() and not clipped[mask.bool()].all()  # both branches of the clip are taken
    assert abs(loss.item() - want.item()) <= RTOL * abs(want.item())
    grads = dict(reference.named_parameters())
    checked = 0
    for name, p in policy.named_parameters():
        if p.grad is None:
            assert grads[name].grad is None or not grads[name].grad.any(), name
            continue
        assert _close(p.grad, grads[name].grad) < RTOL, (name, _close(p.grad, grads[name].grad))
        checked += 1
    assert checked == sum(1 for p in reference.parameters() if p.grad is not None)


class _LargeTensors(TorchDispatchMode):
    """Records, over every tensor an op creates, the largest number of elements of one with a vocabulary-sized
    dimension (``vocab_largest``) and of one with two dimensions longer than ``width`` (``square_largest``: with
    ``width`` above every model width and the vocabulary, only a ``[.., T, T]`` tensor has them)."""

    def __init__(self, vocab, width):
        super().__init__()
        self.vocab, self.width = vocab, width
        self.vocab_largest = self.square_largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor):
                continue
            if self.vocab in t.shape:
                self.vocab_largest = max(self.vocab_largest, t.numel())
            if sum(n > self.width for n in t.shape) >= 2:
                self.square_largest = max(self.square_largest, t.numel())
        return out


def _update(trainer, batch):
    """One GRPO loss forward and backward on ``batch`` (on-policy: TRL takes the old log-probs as the detached new
    ones; no KL)."""
    inputs = dict(batch, advantages=torch.tensor([0.5, -0.5]), num_items_in_batch=batch["completion_mask"].sum())
    trainer._compute_loss(trainer.model, inputs).backward()


@pytest.mark.parametrize("trainer_class", [LongContextGRPOTrainer, GRPOTrainer])
def test_the_update_allocates_no_tokens_by_vocab_and_no_tokens_by_tokens_tensor(folder, tmp_path, small_tiles,
                                                                                 trainer_class):
    """Forward and backward of the GRPO loss create no tensor with a vocabulary dimension larger than one head tile
    or the head's own weight (TRL's fused head, both trainers) and, with LongContextGRPOTrainer, no ``[T, T]``
    tensor although the rows are padded (TRL's own pass builds the MLA layers' padded 4-D mask); the full-logits
    reference does allocate ``[T, V]`` (the detector works)."""
    trainer = _trainer(folder, tmp_path, trainer_class=trainer_class, beta=0.0, max_completion_length=136)
    trainer.model.activation_checkpointing_enable()
    trainer.model.train()
    batch = _rollouts(seed=5, prompt=24, completion=136)
    tokens = 160
    with _LargeTensors(VOCAB, width=VOCAB) as seen:
        _update(trainer, batch)
    bound = max(TOKEN_TILE * VOCAB_TILE, VOCAB * trainer.model.config.hidden_size)  # a tile; lm_head.weight [V, d]
    assert seen.vocab_largest <= bound < tokens * VOCAB // 4, seen.vocab_largest
    if trainer_class is LongContextGRPOTrainer:
        assert seen.square_largest == 0, seen.square_largest
    else:
        assert seen.square_largest >= tokens * tokens  # the padded mask [B, 1, T, T]
        with _LargeTensors(VOCAB, width=VOCAB) as seen:
            _full_logits_reference(_load(folder), batch)
        assert seen.vocab_largest >= (tokens - 1) * VOCAB


def test_real_token_span_refuses_gaps_and_empty_rows():
    assert real_token_span(torch.tensor([0, 0, 1, 1, 1, 0])) == (2, 5)
    with pytest.raises(ValueError, match="between real tokens"):
        real_token_span(torch.tensor([1, 0, 1]))
    with pytest.raises(ValueError, match="without any real token"):
        real_token_span(torch.tensor([0, 0]))


# ------------------------------------------------------------------------------------ the recipe setting


def _grpo_cfg(base, tmp_path, *overrides):  # noqa: F811 (the imported base fixture, which pytest passes by name)
    return _cfg("grpo_single_turn", base, tmp_path, *RL_FAST, *overrides)


def test_long_context_recipe_turns_on_checkpointing_and_checks_the_model(base, tmp_path):  # noqa: F811 (the imported base fixture, which pytest passes by name)
    """``grpo.long_context: true`` builds GRPO with per-layer activation checkpointing (off by default on a CPU) and
    refuses a model whose no-grad passes would not chunk or would ask for router logits; a non-boolean is refused
    naming the value."""
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = KDAMoEForCausalLM.from_pretrained(base, dtype=torch.float32)
    assert not build_trainer(_grpo_cfg(base, tmp_path), model, tokenizer).args.activation_checkpointing
    trainer = build_trainer(_grpo_cfg(base, tmp_path, "grpo.long_context=true"), model, tokenizer)
    assert isinstance(trainer, LongContextGRPOTrainer) and trainer.args.activation_checkpointing
    with pytest.raises(ValueError, match=r"grpo.long_context.*'sometimes'"):
        _grpo_cfg(base, tmp_path, "grpo.long_context=sometimes")
    with pytest.raises(ValueError, match="activation_checkpointing=False"):
        build_trainer(_grpo_cfg(base, tmp_path, "grpo.long_context=true", "trainer.activation_checkpointing=false"),
                      model, tokenizer)
    model.config.prefill_chunk_size = 0
    with pytest.raises(ValueError, match="prefill_chunk_size=0"):
        build_trainer(_grpo_cfg(base, tmp_path, "grpo.long_context=true"), model, tokenizer)
    model.config.prefill_chunk_size = 4096
    model.config.output_router_logits = True
    with pytest.raises(ValueError, match="output_router_logits=True"):
        build_trainer(_grpo_cfg(base, tmp_path, "grpo.long_context=true"), model, tokenizer)


def test_cached_rollout_and_long_context_combine_into_one_trainer(base, tmp_path):  # noqa: F811 (the imported base fixture, which pytest passes by name)
    """``grpo.rollout: cached`` with ``grpo.long_context: true`` (the shipped ``grpo_long``) builds one trainer that
    has both overrides: the cached rollout's ``_tool_call_loop`` and the memory-bounded
    ``_get_per_token_logps_and_entropies``, with checkpointing on."""
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = KDAMoEForCausalLM.from_pretrained(base, dtype=torch.float32)
    trainer = build_trainer(_grpo_cfg(base, tmp_path, "grpo.long_context=true", "grpo.rollout=cached"), model,
                            tokenizer)
    cls = type(trainer)
    assert issubclass(cls, CachedRolloutGRPOTrainer) and issubclass(cls, LongContextGRPOTrainer)
    assert cls._tool_call_loop is CachedRolloutGRPOTrainer._tool_call_loop
    assert cls._get_per_token_logps_and_entropies is LongContextGRPOTrainer._get_per_token_logps_and_entropies
    assert trainer.rollout_func is not None and trainer.args.activation_checkpointing
