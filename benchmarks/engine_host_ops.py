"""Host work of one rollout-engine step, counted on the CPU: aten ops, tensors built from Python data (each one a
host→device copy when the engine runs on a GPU), and host syncs (``.item()`` / ``int()`` / ``float()`` / ``bool()``
on a tensor and ``.tolist()``: each one waits for the GPU), per step and per token-mixer layer.

Why on the CPU: the engine's step issues the same ops whatever the device, so a tiny model's op counts are the
counts a GPU step launches (docs/post-training.md, "Host work of a step"). The engine takes the slot-kernel path it
takes on a GPU (``_slot_kernels`` forced on; the other ops of the model in PyTorch); a slot kernel counts as one op
(its interpreter's own work is not counted).

Run: ``PYTHONPATH=. python benchmarks/engine_host_ops.py`` (about a minute on 2 cores); prints a Markdown table.
Steps are classified by what they feed: ``decode`` (every sequence one token) or ``mixed`` (one-token sequences
next to prefill pieces); the table gives the median over the steps of each kind and slot count.
"""

import os
import statistics
import sys
import traceback
from collections import Counter

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from transformers import GenerationConfig  # noqa: E402

import kdamoe.kernels as kernels  # noqa: E402
from kdamoe import KDAMoEConfig, KDAMoEForCausalLM  # noqa: E402
from kdamoe.posttraining.engine import EpisodeSpec, RolloutEngine  # noqa: E402


class Count(TorchDispatchMode):
    """Counts every aten op dispatched while active and not paused."""

    def __init__(self):
        super().__init__()
        self.ops, self.paused = Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


COUNTER = Count()


def _where(kind):
    """Counts a host event ``kind`` and, under ``@``, the function that caused it (outside torch)."""
    COUNTER.ops[kind] += 1
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in frame.filename:
            COUNTER.ops[f"{kind} @ {os.path.basename(frame.filename)}:{frame.name}"] += 1
            return


def _paused(fn, name):
    def wrapped(*args, **kwargs):
        COUNTER.ops[f"slot kernel {name}"] += 1
        COUNTER.paused += 1
        try:
            return fn(*args, **kwargs)
        finally:
            COUNTER.paused -= 1
    return wrapped


def _synced(method):
    def counted(self, *args):
        if not COUNTER.paused:
            _where("item (sync)")
        return method(self, *args)
    return counted


def _patch():
    for name in ("fused_recurrent_kda_slots", "causal_conv1d_update_slots", "latent_attention_shared_prefix",
                 "write_rows_at"):
        setattr(kernels, name, _paused(getattr(kernels, name), name))
    # the static decode steps' MLA attention (a method of the plan)
    kernels.SharedPrefixPlan.launch = _paused(kernels.SharedPrefixPlan.launch, "SharedPrefixPlan.launch")
    RolloutEngine._slot_kernels = lambda self, attn, x: True
    tolist = torch.Tensor.tolist

    def counted_tolist(self):
        if not COUNTER.paused:
            _where("item (sync)")
        return tolist(self)

    torch.Tensor.tolist = counted_tolist
    for method in ("item", "__int__", "__float__", "__bool__", "__index__"):
        setattr(torch.Tensor, method, _synced(getattr(torch.Tensor, method)))
    build = torch.tensor

    def counted_tensor(data, *args, **kwargs):
        if not isinstance(data, torch.Tensor) and not COUNTER.paused:
            _where("torch.tensor (host data)")
        return build(data, *args, **kwargs)

    torch.tensor = counted_tensor
    step, kda, mla = RolloutEngine._step, RolloutEngine._kda_mix, RolloutEngine._mla_mix

    def step_spy(self, runnable):
        before = Counter(COUNTER.ops)
        self._layer_ops = {"kda": [], "mla": []}
        with COUNTER:
            step(self, runnable)
        ops = COUNTER.ops - before
        fed = self._fed
        kind = "decode" if all(n == 1 for n in fed) else "mixed" if any(n == 1 for n in fed) else "prefill"
        self.records.append((kind, len(fed), ops, {k: sum(v) / max(len(v), 1) for k, v in self._layer_ops.items()}))

    def layer_spy(inner, key):
        def spy(self, attn, x):
            before = sum(n for k, n in COUNTER.ops.items() if "@" not in k)
            out = inner(self, attn, x)
            self._layer_ops[key].append(sum(n for k, n in COUNTER.ops.items() if "@" not in k) - before)
            return out
        return spy

    forward = RolloutEngine._forward

    def forward_spy(self, feeds):
        self._fed = [len(t) for _, t in feeds]
        return forward(self, feeds)

    RolloutEngine._step, RolloutEngine._forward = step_spy, forward_spy
    RolloutEngine._kda_mix, RolloutEngine._mla_mix = layer_spy(kda, "kda"), layer_spy(mla, "mla")


def _model():
    torch.manual_seed(0)
    config = KDAMoEConfig(vocab_size=97, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, kv_lora_rank=16,
                          kda_num_heads=2, kda_head_dim=16, num_experts=8, num_experts_per_tok=2,
                          moe_intermediate_size=16, moe_latent_size=16, intermediate_size=32, attnres_num_blocks=2,
                          kda_chunk_size=16, kernel_backend="torch", pad_token_id=0, bos_token_id=1, eos_token_id=2,
                          max_position_embeddings=512)
    return KDAMoEForCausalLM(config).eval()


def _run(model, slots, do_sample):
    gen = torch.Generator().manual_seed(1)
    groups = max(slots // 8, 1)
    # group g's prompt has 4 + 8·g tokens, fed 8 per step: later groups still prefill while earlier ones decode
    prompts = [torch.randint(3, 97, (4 + 8 * g,), generator=gen).tolist() for g in range(groups)]
    specs = [EpisodeSpec(prompts[i // (slots // groups)], seed=i) for i in range(slots)]
    config = GenerationConfig(do_sample=do_sample, temperature=0.7 if do_sample else None, max_new_tokens=12,
                              pad_token_id=0, top_k=None, top_p=None)
    engine = RolloutEngine(model, config, num_slots=slots, eos_token_ids=[96], max_completion_length=12,
                           prefill_chunk_size=8)
    engine.records = []
    engine.run(specs)
    return engine.records


def main():
    _patch()
    model = _model()
    where = {}
    print("| sampling | slots | fed | step | aten ops / step | from host data (torch.tensor) | syncs (item + tolist) | "
          "ops / KDA layer | ops / MLA layer | steps |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for do_sample in (False, True):
        for slots in (1, 64):
            records = _run(model, slots, do_sample)
            for kind in ("decode", "mixed"):
                picked = [r for r in records if r[0] == kind]
                if kind == "decode":  # the fullest decode steps (with sampling, an eos frees some slots early)
                    picked = [r for r in picked if r[1] == max(q[1] for q in picked)]
                if not picked:
                    continue
                def med(f, picked=picked):
                    return statistics.median(f(r) for r in picked)
                total = med(lambda r: sum(n for k, n in r[2].items() if not k.endswith(")") and "@" not in k))
                lift = med(lambda r: r[2]["torch.tensor (host data)"])
                syncs = med(lambda r: r[2]["item (sync)"])
                if slots == 64 and not do_sample:
                    where[kind] = {k: n for k, n in picked[0][2].items() if "@" in k}
                fed = picked[0][1] if kind == "decode" else "—"
                print(f"| {'sample T=0.7' if do_sample else 'greedy'} | {slots} | {fed} | "
                      f"{kind} | {total:g} | {lift:g} | {syncs:g} | {med(lambda r: r[3]['kda']):g} | "
                      f"{med(lambda r: r[3]['mla']):g} | {len(picked)} |")
    for kind, counts in where.items():
        print(f"\nHost data and syncs of one greedy 64-slot {kind} step, by the function that caused them:")
        for k, n in sorted(counts.items()):
            print(f"- {k}: {n}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
