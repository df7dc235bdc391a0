"""On a CUDA machine with flash-linear-attention installed: every kernel backend of the model against the PyTorch
path, and a saved folder loaded with remote code where ``kdamoe`` cannot be imported picks fla's kernels.

Skipped unless ``KDAMOE_TEST_ON_GPU=1`` and CUDA is available (the CPU suite covers the dispatch decisions with
a fake fla in ``tests/test_kernel_dispatch.py``). The models are dense (``first_k_dense_replace`` = all layers):
top-k routing near ties would otherwise send a few tokens to other experts under different rounding.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kdamoe import KDAMoEForCausalLM
from kdamoe.kernels.utils import relative_error
from tests.helpers import tiny_config

ON_GPU = bool(os.environ.get("KDAMOE_TEST_ON_GPU")) and torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not ON_GPU, reason="needs KDAMOE_TEST_ON_GPU=1 and CUDA")


def _fla_available():
    try:
        import fla.ops.kda  # noqa: F401, PLC0415 (flash-linear-attention is optional: this probes whether it imports)
    except Exception:
        return False
    return True


def _dense_model():
    torch.manual_seed(0)
    config = tiny_config(hidden_size=64, kda_num_heads=2, kda_head_dim=32, num_hidden_layers=4,
                         first_k_dense_replace=4, attnres_num_blocks=2, kernel_backend="torch")
    return KDAMoEForCausalLM(config).cuda().float()


def _run(model, backend, ids, position_ids):
    model.config.kernel_backend = backend
    model.zero_grad(set_to_none=True)
    out = model(ids, position_ids=position_ids, labels=ids, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


@pytest.mark.parametrize("backend", ["triton", "fla"])
def test_backend_matches_torch_on_a_packed_training_step(backend):
    if backend == "fla" and not _fla_available():
        pytest.skip("flash-linear-attention is not installed")

    model = _dense_model().train()
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 97, (1, 300), generator=g).cuda()
    position_ids = torch.cat([torch.arange(130), torch.arange(170)]).unsqueeze(0).cuda()
    ref_logits, ref_grads = _run(model, "torch", ids, position_ids)
    logits, grads = _run(model, backend, ids, position_ids)
    assert relative_error(logits, ref_logits) < 1e-2
    for name in ref_grads:  # the kernels' float32 products are tf32 on the GPU
        if not ref_grads[name].any():  # zero-initialised AttnRes queries give their key norms no gradient yet
            assert not grads[name].any(), name
            continue
        assert relative_error(grads[name], ref_grads[name]) < 3e-2, name


def test_remote_code_folder_without_kdamoe_uses_fla(tmp_path):
    if not _fla_available():
        pytest.skip("flash-linear-attention is not installed")
    model = _dense_model().eval()
    model.config.kernel_backend = "auto"
    model.save_pretrained(tmp_path)
    ids = torch.randint(3, 97, (2, 70), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model.config.kernel_backend = "torch"
        ref = model(ids.cuda(), use_cache=False).logits.float().cpu()
    torch.save(ids, tmp_path / "ids.pt")
    torch.save(ref, tmp_path / "ref.pt")
    script = textwrap.dedent(f"""
        import importlib.abc, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "kdamoe" or name.startswith("kdamoe."):
                    raise ImportError("kdamoe is blocked in this process")
        sys.meta_path.insert(0, Block())
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}, trust_remote_code=True).cuda().eval()
        dispatch = sys.modules[type(model).__module__.rsplit(".", 1)[0] + ".kernel_dispatch"]
        assert dispatch.resolve("auto", torch.device("cuda"), "chunk_kda") == "fla"
        assert dispatch.resolve("auto", torch.device("cuda"), "causal_conv1d") in ("fla", "torch")
        ids, ref = torch.load({str(tmp_path / 'ids.pt')!r}), torch.load({str(tmp_path / 'ref.pt')!r})
        with torch.no_grad():
            out = model(ids.cuda(), use_cache=False).logits.float().cpu()
            gen = model.generate(ids[:1].cuda(), max_new_tokens=5, do_sample=False)
        err = float((out - ref).norm() / ref.norm())
        assert err < 1e-2, err
        assert gen.shape == (1, 75)
        print("fla path ok", err)
    """)
    env = {k: v for k, v in os.environ.items()}
    env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                        if p and os.path.abspath(p) != os.path.abspath(os.getcwd()))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "fla path ok" in done.stdout
