"""What a user gets from ``kdamoe-convert`` and ``KDAMoEForCausalLM.from_pretrained`` for a Kimi Linear folder that is
broken or unusual: a one-line ``ValueError`` naming the bad value (exit status 2 from the command), never a traceback
from inside transformers or safetensors, never a silently different model; and what the converter leaves on disk.

The folders are tiny ``KimiLinearForCausalLM`` checkpoints (transformers' own class and ``save_pretrained``, the
released layout) of the "kda-ends" config of ``tests/test_kimi_linear_checkpoints.py``, edited on disk the way a
hand-edited or half-copied checkpoint would be. The float32 tensors of a bf16 folder are checked against the dtypes
transformers' own class gives them when it loads the same folder.
"""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import KimiLinearConfig, KimiLinearForCausalLM

import kdamoe.conversion as conversion
from kdamoe import KDAMoEForCausalLM
from kdamoe.cli import convert_main
from kdamoe.conversion import convert_checkpoint
from tests.test_kimi_linear_checkpoints import CONFIGS

RAW = CONFIGS["kda-ends"]  # 3 layers: KDA, MLA, KDA (1-based full_attn_layers=[2], kda_layers=[1, 3])


@pytest.fixture(scope="module")
def kimi_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kimi")
    torch.manual_seed(0)
    KimiLinearForCausalLM(KimiLinearConfig.from_dict(RAW)).save_pretrained(folder)
    return folder


def _copy_with_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _cli_error(capsys, *argv) -> str:
    """The last stderr line of ``kdamoe-convert ARGV``, which must exit with status 2."""
    with pytest.raises(SystemExit) as stop:
        convert_main([str(a) for a in argv])
    assert stop.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


LINEAR = RAW["linear_attn_config"]
# transformers' save_pretrained writes layer_types next to linear_attn_config, and layer_types wins; the released
# config.json has only the 1-based lists, so the cases that edit them drop layer_types as the release has it.
BAD_CONFIGS = {
    # layer 2 in neither list: transformers' KimiLinearConfig refused it with a strict-dataclass traceback
    "layer-in-neither-list": (dict(linear_attn_config=dict(LINEAR, full_attn_layers=[]), layer_types=None),
                              r"layer 2 \(1-based\) is in neither"),
    # a 0 in the 1-based list lands on the last layer in transformers (index -1): a silently different model before
    "layer-zero": (dict(linear_attn_config=dict(LINEAR, full_attn_layers=[0, 2]), layer_types=None),
                   r"full_attn_layers holds 0"),
    "layer-past-the-end": (dict(linear_attn_config=dict(LINEAR, kda_layers=[1, 3, 4]), layer_types=None),
                           r"kda_layers holds 4"),
    "linear-attn-config-null": (dict(linear_attn_config=None, layer_types=None), r"linear_attn_config is None"),
    "mlp-layer-types-short": (dict(mlp_layer_types=["dense", "sparse"]), r"KimiLinearConfig refuses.*mlp_layer_types"),
    "layer-count-mismatch": (dict(num_hidden_layers=4, layer_types=None, mlp_layer_types=None),
                             r"layer 4 \(1-based\) is in neither"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_kimi_config_is_one_line_value_error(case, kimi_folder, tmp_path, capsys):
    changes, message = BAD_CONFIGS[case]
    src = _copy_with_config(kimi_folder, tmp_path / "src", **changes)
    with pytest.raises(ValueError, match=message) as err:
        KDAMoEForCausalLM.from_pretrained(src)
    assert "\n" not in str(err.value)
    line = _cli_error(capsys, src, tmp_path / "dst", "--to", "kda_moe")
    assert line.startswith("kdamoe-convert: error:") and re.search(message, line)
    assert not (tmp_path / "dst").exists()


def test_config_that_is_not_json(kimi_folder, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(kimi_folder, src)
    (src / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON"):
        KDAMoEForCausalLM.from_pretrained(src)
    assert "not valid JSON" in _cli_error(capsys, src, tmp_path / "dst", "--to", "kda_moe")


def test_truncated_shard_is_named(kimi_folder, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(kimi_folder, src)
    weights = src / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        KDAMoEForCausalLM.from_pretrained(src)
    assert str(weights) in _cli_error(capsys, src, tmp_path / "dst", "--to", "kda_moe")
    assert not (tmp_path / "dst").exists() and not list(tmp_path.glob(".dst.converting-*"))


def test_shard_missing_from_an_index(kimi_folder, tmp_path, capsys):
    src = tmp_path / "src"
    KimiLinearForCausalLM.from_pretrained(kimi_folder).save_pretrained(src, max_shard_size="20KB")
    shards = sorted(src.glob("model-*.safetensors"))
    assert len(shards) > 2
    shards[1].unlink()
    with pytest.raises(ValueError, match=rf"{shards[1].name}: no such file"):
        KDAMoEForCausalLM.from_pretrained(src)
    assert f"{shards[1].name}: no such file" in _cli_error(capsys, src, tmp_path / "dst", "--to", "kda_moe")


def test_max_shard_size_in_plain_bytes(kimi_folder, tmp_path, capsys):
    """``--max-shard-size 30000`` (bytes, as the message asks for) is a limit; 0 is refused as not positive."""
    assert convert_main([str(kimi_folder), str(tmp_path / "dst"), "--to", "kda_moe", "--max-shard-size", "30000"]) == 0
    shards = sorted((tmp_path / "dst").glob("model-*.safetensors"))
    assert len(shards) > 1
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            tensors = [f.get_slice(k) for k in f.keys()]
        sizes = [torch.Size(t.get_shape()).numel() * 4 for t in tensors]  # float32
        assert sum(sizes) <= 30000 or len(sizes) == 1
    assert "must be a positive size" in _cli_error(capsys, kimi_folder, tmp_path / "d0", "--to", "kda_moe",
                                                   "--max-shard-size", "0")


def test_killed_conversion_leftover_is_removed_by_the_next_run(kimi_folder, tmp_path):
    """A conversion killed with ``kill -9`` leaves its hidden ``.DST.converting-PID`` folder; the next conversion to
    the same DST removes it when that process is gone, and leaves one of a process that still runs."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its pid names no process
    stale = tmp_path / f".dst.converting-{dead.pid}"
    stale.mkdir()
    (stale / ".part-00000.safetensors").write_bytes(b"x" * 100)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        running = tmp_path / f".dst.converting-{alive.pid}"
        running.mkdir()
        convert_checkpoint(kimi_folder, tmp_path / "dst", to="kda_moe")
        assert not stale.exists()
        assert running.exists()
    finally:
        alive.kill()
        alive.wait()
    assert (tmp_path / "dst" / "model.safetensors").is_file()


def test_destination_given_as_a_symbolic_link(kimi_folder, tmp_path):
    """A DST that is a link (to a folder on another disk, say) is written through; before, the finished conversion
    ended in ``OSError: Cannot call rmtree on a symbolic link`` and was thrown away."""
    target = tmp_path / "disk" / "out"
    target.mkdir(parents=True)
    (target / "notes.txt").write_text("mine")
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(ValueError, match=r"exists and is not empty \(notes\.txt\)"):
        convert_checkpoint(kimi_folder, link, to="kda_moe")
    assert (target / "notes.txt").read_text() == "mine"
    (target / "notes.txt").rename(target / "model.safetensors")  # an older checkpoint's weights: --overwrite's to take
    convert_checkpoint(kimi_folder, link, to="kda_moe", overwrite=True)
    assert link.is_symlink() and (link / "model.safetensors").is_file() and (link / "config.json").is_file()
    assert not list((tmp_path / "disk").glob(".out.converting-*"))


def test_bf16_folder_keeps_the_float32_tensors_without_a_dtype(kimi_folder, tmp_path):
    """From a folder stored in bf16, with no ``dtype`` (as stored), the router weights and biases and the gate's
    ``dt_bias`` / ``A_log`` are float32 as in transformers' own class loading the same folder."""
    src = tmp_path / "bf16"
    KimiLinearForCausalLM.from_pretrained(kimi_folder, dtype=torch.float32).to(torch.bfloat16).save_pretrained(src)
    reference = dict(KimiLinearForCausalLM.from_pretrained(src).named_parameters())
    model = dict(KDAMoEForCausalLM.from_pretrained(src).named_parameters())
    model.update(dict(KDAMoEForCausalLM.from_pretrained(src).named_buffers()))
    reference.update(dict(KimiLinearForCausalLM.from_pretrained(src).named_buffers()))
    pairs = {"model.layers.1.mlp.gate.weight": "model.layers.1.mlp.gate.weight",
             "model.layers.1.mlp.gate.e_score_correction_bias": "model.layers.1.mlp.gate.e_score_correction_bias",
             "model.layers.0.self_attn.dt_bias": "model.layers.0.self_attn.forget_gate.dt_bias"}
    for ours, theirs in pairs.items():
        assert reference[theirs].dtype == torch.float32, theirs
        assert model[ours].dtype == torch.float32, ours
    assert model["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.int8, "int64", "float33"])
def test_dtype_that_is_not_a_float_dtype(kimi_folder, dtype):
    """An integer dtype failed inside ``load_state_dict`` (``RuntimeError``) after every shard was read."""
    with pytest.raises(ValueError, match=r"dtype is .*expected a floating-point torch\.dtype"):
        KDAMoEForCausalLM.from_pretrained(kimi_folder, dtype=dtype)


def test_folder_without_config(kimi_folder, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(kimi_folder, src)
    (src / "config.json").unlink()
    assert _cli_error(capsys, src, tmp_path / "dst", "--to", "kda_moe").endswith(
        f"{src}: no config.json (the folder has none)")


def test_files_added_to_an_empty_destination_during_the_conversion_are_kept(kimi_folder, tmp_path, monkeypatch):
    """DST was empty when the conversion started (so no --overwrite was needed); a file the user puts there while
    it runs (hours for the 48B model) is not deleted when the result is moved in: the conversion stops, naming the
    folder it left its result in."""
    dst = tmp_path / "dst"
    dst.mkdir()
    copy = conversion._copy_side_files

    def user_writes_meanwhile(*args):
        (dst / "notes.txt").write_text("mine")
        return copy(*args)

    monkeypatch.setattr(conversion, "_copy_side_files", user_writes_meanwhile)
    with pytest.raises(ValueError, match=r"files were added to it during the conversion.*dst\.converted-"):
        convert_checkpoint(kimi_folder, dst, to="kda_moe")
    assert (dst / "notes.txt").read_text() == "mine"
    kept = list(tmp_path.glob("dst.converted-*"))
    assert len(kept) == 1 and (kept[0] / "model.safetensors").is_file()


def test_destination_inside_the_source_is_refused(kimi_folder, tmp_path, capsys):
    """Before, SRC/out was written; a second conversion of SRC then copied SRC/out (its config, model code and
    generation config) into the new DST as one of the source's "other files"."""
    src = tmp_path / "src"
    shutil.copytree(kimi_folder, src)
    line = _cli_error(capsys, src, src / "out", "--to", "kda_moe")
    assert line.endswith(f"dst {src / 'out'}: is inside the source folder {src}; pick a folder outside it")
    assert sorted(p.name for p in src.iterdir()) == sorted(p.name for p in kimi_folder.iterdir())


def test_overwrite_replaces_a_checkpoint_but_not_someone_elses_files(kimi_folder, tmp_path, capsys):
    """``--overwrite`` on a DST that holds an earlier conversion (other shard names, its model code) replaces it; on a
    DST that also holds files no conversion writes (notes, a data folder), it is refused before anything is converted
    and nothing there is touched. Before, ``shutil.rmtree`` removed the whole folder."""
    dst = tmp_path / "dst"
    convert_checkpoint(kimi_folder, dst, to="kda_moe", max_shard_size="30KB")
    assert (dst / "model.safetensors.index.json").is_file()
    convert_checkpoint(kimi_folder, dst, to="kda_moe", overwrite=True)
    assert (dst / "model.safetensors").is_file() and not (dst / "model.safetensors.index.json").exists()

    (dst / "notes.txt").write_text("mine")
    (dst / "data").mkdir()
    (dst / "data" / "rows.csv").write_text("1,2")
    before = sorted(p.name for p in dst.iterdir())
    line = _cli_error(capsys, kimi_folder, dst, "--to", "kda_moe", "--overwrite")
    assert line.endswith(f"dst {dst}: --overwrite would delete data, notes.txt, which a conversion does not write; "
                         "move them away or pick another folder")
    assert sorted(p.name for p in dst.iterdir()) == before
    assert (dst / "notes.txt").read_text() == "mine" and (dst / "data" / "rows.csv").read_text() == "1,2"


@pytest.mark.parametrize("stored", ["bf16", "int8", 3])
def test_config_dtype_that_names_no_float_dtype(kimi_folder, tmp_path, stored):
    """A config.json whose ``dtype`` names no floating-point torch dtype: one ValueError naming it (before, 'bf16'
    raised an AttributeError from transformers' config, which resolves the name with getattr(torch, name))."""
    src = _copy_with_config(kimi_folder, tmp_path / "src", dtype=stored)
    with pytest.raises(ValueError, match=re.escape(f"dtype is {stored!r}")):
        KDAMoEForCausalLM.from_pretrained(src)


def test_experts_dtype_is_refused_where_no_experts_are_quantised(kimi_folder, tmp_path, capsys):
    """``--experts-dtype`` means something only for ``--to kimi_k3``; elsewhere it was accepted and ignored."""
    line = _cli_error(capsys, kimi_folder, tmp_path / "dst", "--to", "kda_moe", "--experts-dtype", "bf16")
    assert "--experts-dtype bf16: only --to kimi_k3" in line
    assert not (tmp_path / "dst").exists()
