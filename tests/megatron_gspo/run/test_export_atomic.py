"""`megatron-gspo export` is atomic (issue 30): killed or failing part-way it leaves no folder
that transformers would load with a tokenizer missing or cut short; a re-run clears what a killed
one left and says so; every file follows the umask."""

import errno
import json
import os
import signal
import subprocess
import sys

import pytest

from megatron_gspo.run import export as export_mod
from megatron_gspo.cli import main as cli_main
from tests.hf_fixtures import make_model
from tests.megatron_gspo.hf_runs import run_config, save_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory, single_process):
    """A run dir started from a tiny Qwen3-MoE folder (its tokenizer included), one step saved."""
    from megatron_gspo.run.setup import build_policy

    folder = str(tmp_path_factory.mktemp("qwen3"))
    make_model(folder, "qwen3_moe", seed=2)
    cfg = run_config(folder, str(tmp_path_factory.mktemp("run") / "run"))
    save_run(build_policy(cfg, 300, optim=None), cfg, cfg.run_dir)
    return cfg.run_dir


_KILLED_AT_THE_TOKENIZER = """
import os, shutil, signal, sys
from megatron_gspo.run import export
copy = shutil.copy2
def copy_then_die(src, dst, **kwargs):
    if os.path.basename(src) == "tokenizer.json":
        os.kill(os.getpid(), signal.SIGKILL)
    return copy(src, dst, **kwargs)
shutil.copy2 = copy_then_die
export.export_run(sys.argv[1], sys.argv[2])
"""


def test_an_export_killed_at_the_tokenizer_leaves_no_folder_and_a_rerun_says_so(
        hf_run, tmp_path, capsys):
    """Killed while copying the tokenizer, the export left config.json and model.safetensors
    in OUT: transformers loaded the model and AutoTokenizer a one-token tokenizer. Now OUT does
    not exist until complete; the re-run removes the leftovers, naming them."""
    out = str(tmp_path / "hf")
    proc = subprocess.run([sys.executable, "-c", _KILLED_AT_THE_TOKENIZER, hf_run, out],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert not os.path.exists(out)
    assert "model.safetensors" in os.listdir(out + ".partial")
    assert cli_main(["export", "--run-dir", hf_run, "--to-hf", out]) == 0
    err = capsys.readouterr().err
    assert f"removing {out}.partial, left by an export that did not finish" in err
    assert not os.path.exists(out + ".partial")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
    assert export_mod.PARTIAL_MARKER not in os.listdir(out)


def test_a_disk_full_at_the_tokenizer_keeps_out_absent_and_is_one_line(hf_run, tmp_path,
                                                                       capsys, monkeypatch):
    """The disk fills while the tokenizer is copied: a cut-off tokenizer.json stayed in OUT
    beside the weights. Now a one-line error and no OUT (nor its staging folder)."""
    out = str(tmp_path / "hf")

    def full_disk(src, dst, only=None):
        with open(os.path.join(dst, "tokenizer.json"), "w") as f:
            f.write('{"version": "1.0", "trunc')
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(export_mod, "_copy_tokenizer_files", full_disk)
    assert cli_main(["export", "--run-dir", hf_run, "--to-hf", out]) == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and len(err.strip().splitlines()) == 1, err
    assert not os.path.exists(out) and not os.path.exists(out + ".partial")


def test_a_disk_full_while_writing_the_weights_is_one_line(hf_run, tmp_path, capsys,
                                                           monkeypatch):
    """The disk fills while safetensors writes a weight shard: a 21-line SafetensorError
    traceback. Now one line with the OS reason, as at the tokenizer, and no OUT (nor its
    staging folder). The error is safetensors' own for ENOSPC (a tmpfs filled up gives it)."""
    import safetensors
    import safetensors.torch

    out = str(tmp_path / "hf")

    def full_disk(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\x00" * 64)
        raise safetensors.SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    assert cli_main(["export", "--run-dir", hf_run, "--to-hf", out]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "No space left on device" in err and "model.safetensors" in err, err
    assert not os.path.exists(out) and not os.path.exists(out + ".partial")


def test_a_staging_folder_not_left_by_an_export_is_not_removed(hf_run, tmp_path, capsys):
    out = tmp_path / "hf"
    (tmp_path / "hf.partial").mkdir()
    (tmp_path / "hf.partial" / "mine.txt").write_text("keep")
    assert cli_main(["export", "--run-dir", hf_run, "--to-hf", str(out)]) == 2
    assert "was not left by an export; move it away" in capsys.readouterr().err
    assert (tmp_path / "hf.partial" / "mine.txt").read_text() == "keep" and not out.exists()


def test_exported_files_follow_the_umask(hf_run, tmp_path, capsys):
    """safetensors wrote model.safetensors 0600 while config.json and the tokenizer were 0644."""
    out = tmp_path / "hf"
    old = os.umask(0o022)
    try:
        assert cli_main(["export", "--run-dir", hf_run, "--to-hf", str(out)]) == 0
    finally:
        os.umask(old)
    modes = {name: oct(os.stat(out / name).st_mode & 0o777) for name in os.listdir(out)}
    assert set(modes.values()) == {"0o644"}, modes
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["out"] == str(out) and "model.safetensors" in summary["files"]
