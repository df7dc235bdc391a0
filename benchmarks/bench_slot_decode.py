"""The rollout engine's decode step per layer, slot kernels against the engine's former path, on one GPU (bf16).

For N active slots of a pool (``--slots``, default 1, 8, 32, 64), one decode token each, at the 1.68 B shape:

(a) KDA (H = 8, K = V = 128, gate and L2 norm in the kernel): the former path gathers the slots' float32 states
    from the pool, gathers the decode subset again, runs ``fused_recurrent_kda`` and scatters the final states back
    (``RolloutEngine._kda_sequences``), against ``fused_recurrent_kda_slots`` updating the pool in place.
(b) short conv (C = 3·H·K = 3072, W = 4): gather the windows, ``causal_conv1d_update``, the new window by
    concatenation and gather, scatter, against ``causal_conv1d_update_slots`` in place.
(c) MLA in the latent space (8 heads, ``kv_lora_rank`` 256): GRPO groups of ``--group`` members sharing a prefix of
    ``--prefix`` rows, each with ``--own`` rows of its own. The former path is the engine's PyTorch loop (per group:
    the prefix cast to float32, scores and values with einsum; per member the same over its own rows); against
    ``latent_attention_shared_prefix`` (one launch, the prefix read once per group, every buffer read in place).

Times are ``triton.testing.do_bench`` medians of one call (the pools keep evolving from call to call, as in the
engine). ``err`` is the relative L2 difference of the slot kernel's output from the former path's, from the same
pools. Writes ``slot_decode.json`` and ``slot_decode.md`` into ``--out`` (default ``$OUT``, else ``./bench_out``).
``--smoke`` runs tiny sizes in float32 on the CPU under ``TRITON_INTERPRET=1`` (timings there mean nothing) to check
the script itself.
"""

import argparse
import os
import sys

if "--smoke" in sys.argv[1:]:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first @triton.jit definition

import torch  # noqa: E402  (after TRITON_INTERPRET is set for --smoke)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import commit, device_name, fmt, ints, kernels_only, time_ms, write_json, write_text  # noqa: E402

kernels_only()  # kdamoe.kernels needs torch and triton only

from kdamoe.kernels import (  # noqa: E402  (after kernels_only())
    causal_conv1d_update,
    causal_conv1d_update_slots,
    fused_recurrent_kda,
    fused_recurrent_kda_slots,
    latent_attention_shared_prefix,
)
from kdamoe.kernels.utils import relative_error  # noqa: E402  (the same)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU interpreter (checks the script)")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    parser.add_argument("--slots", type=ints, default=None, help="active slots N (default 1,8,32,64; smoke 1,3)")
    parser.add_argument("--prefix", type=int, default=None, help="MLA prefix rows per group (default 32768)")
    parser.add_argument("--own", type=int, default=None, help="MLA own rows per sequence (default 512)")
    parser.add_argument("--group", type=int, default=8, help="members per GRPO group (default 8)")
    args = parser.parse_args(argv)
    for name in ("prefix", "own"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.group < 1 or (args.slots is not None and (not args.slots or min(args.slots) < 1)):
        parser.error("--group and every --slots value must be >= 1")
    return args


def kda_rows(N, H, K, dtype, device, pool_slots, gen):
    """One decode token per sequence (q|k|v columns of one tensor, as the engine's conv writes them) and a pool."""
    qkv = torch.randn(N, 3 * H * K, generator=gen).to(dtype).to(device)
    q, k, v = (qkv[:, i * H * K:(i + 1) * H * K].view(N, H, K) for i in range(3))
    f = torch.randn(N, H, K, generator=gen).to(dtype).to(device)
    beta = torch.rand(N, H, generator=gen).to(device)
    pool = torch.randn(pool_slots, H, K, K, generator=gen).to(device) * 0.1
    gate = dict(A_log=(torch.randn(H, generator=gen) * 0.5).to(device),
                dt_bias=torch.randn(H * K, generator=gen).to(device))
    return q, k, v, f, beta, pool, gate


def bench_kda(N, H, K, dtype, device, cuda, gen):
    q, k, v, f, beta, pool, gate = kda_rows(N, H, K, dtype, device, max(N, 64), gen)
    slots = torch.randperm(pool.shape[0], generator=gen)[:N].to(device)
    slots32, seqs = slots.to(torch.int32), torch.arange(N, device=device)
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-5.0, **gate)

    def former(p):
        initial = p[slots]  # RolloutEngine._kda_sequences: the pool gather, then the decode subset
        o, final = fused_recurrent_kda(*(t[:, None] for t in (q, k, v, f, beta)), initial_state=initial[seqs],
                                       output_final_state=True, **kw)
        p[slots[seqs]] = final.float()
        return o[:, 0]

    def slot(p):
        return fused_recurrent_kda_slots(q, k, v, f, beta, p, slots32, check_slot_ids_values=False, **kw)

    err = relative_error(slot(pool.clone()), former(pool.clone()).float())
    return time_ms(lambda: former(pool), cuda), time_ms(lambda: slot(pool), cuda), err


def bench_conv(N, C, W, dtype, device, cuda, gen):
    x = torch.randn(N, C, generator=gen).to(dtype).to(device)
    weight = (torch.randn(C, W, generator=gen) / W ** 0.5).to(dtype).to(device)
    pool = torch.randn(max(N, 64), C, W, generator=gen).to(dtype).to(device)
    slots = torch.randperm(pool.shape[0], generator=gen)[:N].to(device)
    slots32 = slots.to(torch.int32)

    def former(p):
        state = p[slots]  # gather; the op; the new window as the engine built it (concatenate, gather); scatter
        y, _ = causal_conv1d_update(x, state, weight)
        window = torch.cat([state.transpose(1, 2), x[:, None]], 1)
        at = (torch.ones(N, 1, dtype=torch.long, device=device) + torch.arange(W, device=device))[..., None]
        p[slots] = window.gather(1, at.expand(N, W, C)).transpose(1, 2)
        return y

    def slot(p):
        return causal_conv1d_update_slots(x, p, slots32, weight, check_slot_ids_values=False)

    err = relative_error(slot(pool.clone()), former(pool.clone()).float())
    return time_ms(lambda: former(pool), cuda), time_ms(lambda: slot(pool), cuda), err


def bench_mla(N, H, R, prefix_len, own_len, group_size, dtype, device, cuda, gen):
    G = -(-N // group_size)
    q = torch.randn(N, H, R, generator=gen).to(dtype).to(device)
    prefixes = [torch.randn(prefix_len, R, generator=gen).to(dtype).to(device) for _ in range(G)]
    own = [torch.randn(own_len, R, generator=gen).to(dtype).to(device) for _ in range(N)]
    group = [n // group_size for n in range(N)]
    scale = R ** -0.5

    def former():  # RolloutEngine._mla_mix's loop, one decode token per member
        o = torch.zeros(N, H, R, dtype=torch.float32, device=device)
        for g in range(G):
            members = [n for n in range(N) if group[n] == g]
            queries = q[members].float()
            prefix = prefixes[g]
            s_prefix = torch.einsum("nhr,lr->nhl", queries, prefix.float()) * scale
            p_prefix = []
            for i, n in enumerate(members):
                keys = own[n].float()
                s_own = torch.einsum("hr,lr->hl", queries[i], keys) * scale
                p = torch.softmax(torch.cat([s_prefix[i], s_own], -1), dim=-1)
                p_prefix.append(p[:, :prefix_len])
                o[n] = p[:, prefix_len:] @ keys
            o[members] += torch.einsum("nhl,lr->nhr", torch.stack(p_prefix), prefix.float())
        return o

    def slot():
        return latent_attention_shared_prefix(q, prefixes, group, own, scale, value_dim=R)

    err = relative_error(slot(), former())
    return time_ms(former, cuda), time_ms(slot, cuda), err


def main(argv=None):
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        raise SystemExit("bench_slot_decode.py needs a CUDA GPU (or --smoke on the CPU interpreter)")
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.smoke:
        H, K, R, mla_heads = 2, 16, 16, 2
        slots_list, prefix_len, own_len = args.slots or [1, 3], args.prefix or 40, args.own or 5
    else:
        H, K, R, mla_heads = 8, 128, 256, 8
        slots_list, prefix_len, own_len = args.slots or [1, 8, 32, 64], args.prefix or 32768, args.own or 512
    gen = torch.Generator().manual_seed(0)
    rows = []
    with torch.no_grad():
        for N in slots_list:
            for op, run in (("kda", lambda n=N: bench_kda(n, H, K, dtype, device, cuda, gen)),
                            ("conv", lambda n=N: bench_conv(n, 3 * H * K, 4, dtype, device, cuda, gen)),
                            ("mla", lambda n=N: bench_mla(n, mla_heads, R, prefix_len, own_len, args.group, dtype,
                                                          device, cuda, gen))):
                former_ms, slot_ms, err = run()
                rows.append(dict(op=op, N=N, former_ms=former_ms, slot_ms=slot_ms, speedup=former_ms / slot_ms,
                                 err=err))
                print(f"{op:5s} N={N:3d} former {former_ms:.4f} ms  slot {slot_ms:.4f} ms  err {err:.2e}", flush=True)
    meta = dict(device=device_name(cuda, "cpu (interpreter smoke)"), dtype=str(dtype), commit=commit(),
                kda=dict(H=H, K=K), conv=dict(C=3 * H * K, W=4),
                mla=dict(heads=mla_heads, R=R, prefix=prefix_len, own=own_len, group=args.group),
                torch=torch.__version__)
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "slot_decode.json"), dict(meta=meta, rows=rows))
    lines = [f"# Slot decode kernels against the engine's former path ({meta['device']}, {dtype})", "",
             f"KDA H={H} K=V={K}; conv C={3 * H * K} W=4; MLA {mla_heads} heads, R={R}, prefix {prefix_len} rows per "
             f"group of {args.group}, {own_len} own rows per sequence. Commit {meta['commit']}.", "",
             "| op | N | former (ms) | slot (ms) | speedup | err |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['op']} | {r['N']} | {fmt(r['former_ms'])} | {fmt(r['slot_ms'])} | {fmt(r['speedup'])} | "
              f"{r['err']:.2e} |" for r in rows]
    write_text(os.path.join(args.out, "slot_decode.md"), "\n".join(lines) + "\n")
    return rows


if __name__ == "__main__":
    main()
