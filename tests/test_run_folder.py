"""A run owns its output folder (kdamoe.common.run_folder): one writer, no other job's run, nothing foreign removed."""

import json
import os
import subprocess
import sys
import time

import pytest

from kdamoe.common.run_folder import (
    LOCK_NAME,
    RUN_MARKER,
    RunFolderError,
    RunFolderLock,
    claim_run_folder,
    detect_job,
)

HOLD = """
import sys, time
from kdamoe.common.run_folder import RunFolderLock
with RunFolderLock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(60)
"""


def test_a_second_writer_is_refused_while_the_first_runs(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunFolderError, match=f"another run is writing here \\(pid {holder.pid} on this host"):
            RunFolderLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    # kill -9 left its lock behind: the next run takes it over, saying so
    assert (tmp_path / LOCK_NAME).is_file()
    said = []
    with RunFolderLock(tmp_path, say=said.append):
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert said and f"stale lock of pid {holder.pid}" in said[0]
    assert not (tmp_path / LOCK_NAME).exists()


def test_the_lock_is_released_when_the_run_raises(tmp_path):
    with pytest.raises(RuntimeError), RunFolderLock(tmp_path):
        raise RuntimeError("crash inside the run")
    assert not (tmp_path / LOCK_NAME).exists()
    with RunFolderLock(tmp_path):  # free again
        pass


def test_a_lock_of_another_host_is_not_taken_over(tmp_path):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": "elsewhere-7", "pid": 1, "since": "then"}))
    with pytest.raises(RunFolderError, match="host elsewhere-7"):
        RunFolderLock(tmp_path).acquire()


def test_posttraining_refuses_a_pretraining_run_folder(tmp_path):
    # a pretraining folder written before markers existed: recognised by its files
    (tmp_path / "config.yaml").write_text("seed: 0\n")
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "final").mkdir()
    assert detect_job(tmp_path) == "pretraining"
    with pytest.raises(RunFolderError, match="holds a pretraining run .*your base model"):
        claim_run_folder(tmp_path, "posttraining", resuming=False, overwrite=True)
    assert (tmp_path / "final").is_dir()  # nothing removed, even with overwrite
    claim_run_folder(tmp_path, "pretraining", resuming=True)
    assert json.loads((tmp_path / RUN_MARKER).read_text())["job"] == "pretraining"
    with pytest.raises(RunFolderError, match=f"holds a pretraining run \\({RUN_MARKER}\\)"):
        claim_run_folder(tmp_path, "posttraining", resuming=False)


def test_a_fresh_start_refuses_a_folder_with_files_and_overwrite_removes_only_the_jobs_own(tmp_path):
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "model.safetensors").write_text("old")
    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer.json").write_text("{}")
    (tmp_path / "tokenizer" / "mine.txt").write_text("a user's file inside a folder the run writes")
    (tmp_path / "my_notes.txt").write_text("keep me")
    with pytest.raises(RunFolderError, match="not empty and nothing to resume from .*final, my_notes.txt, "
                                             "summary.json, tokenizer.*--overwrite.*my_notes.txt would stay"):
        claim_run_folder(tmp_path, "pretraining", resuming=False)
    assert (tmp_path / "final" / "model.safetensors").read_text() == "old"
    said = []
    claim_run_folder(tmp_path, "pretraining", resuming=False, overwrite=True, say=said.append)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["my_notes.txt", "tokenizer", RUN_MARKER])
    assert (tmp_path / "my_notes.txt").read_text() == "keep me"
    # inside tokenizer/ only the files a run writes went; the user's file stayed (it once went with the folder)
    assert [p.name for p in (tmp_path / "tokenizer").iterdir()] == ["mine.txt"]
    assert any("keeping my_notes.txt" in line for line in said)


def test_an_empty_or_missing_folder_and_a_resume_are_accepted(tmp_path):
    claim_run_folder(tmp_path / "new" / "run", "posttraining", resuming=False)
    assert detect_job(tmp_path / "new" / "run") == "posttraining"
    run = tmp_path / "resumed"
    (run / "checkpoint-4").mkdir(parents=True)
    (run / "checkpoint-4" / "trainer_state.json").write_text("{}")
    assert detect_job(run) == "posttraining"
    claim_run_folder(run, "posttraining", resuming=True)
    assert (run / "checkpoint-4").is_dir()


def test_bad_markers_and_arguments_are_value_errors(tmp_path):
    (tmp_path / RUN_MARKER).write_text("{not json")
    with pytest.raises(RunFolderError, match="not valid JSON"):
        detect_job(tmp_path)
    (tmp_path / RUN_MARKER).write_text(json.dumps({"job": "eval"}))
    with pytest.raises(RunFolderError, match="expected"):
        detect_job(tmp_path)
    with pytest.raises(ValueError, match="job 'serving'"):
        claim_run_folder(tmp_path / "x", "serving", resuming=False)
    (tmp_path / "file").write_text("")
    with pytest.raises(RunFolderError, match="not a folder"):
        claim_run_folder(tmp_path / "file", "pretraining", resuming=False)
    with pytest.raises(RunFolderError, match="not a folder"):  # a FileExistsError traceback before
        RunFolderLock(tmp_path / "file").acquire()


def test_stale_lock_timestamp_is_irrelevant_only_the_pid_counts(tmp_path):
    # an old lock of a live process (this one) is still a held lock
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": os.uname().nodename, "pid": os.getpid(),
                                                  "since": time.strftime("2000-01-01T00:00:00")}))
    with pytest.raises(RunFolderError, match=f"pid {os.getpid()}"):
        RunFolderLock(tmp_path).acquire()
