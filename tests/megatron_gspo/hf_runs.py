"""Helpers shared by the tests of a run from model.hf_path (`test_hf_run.py`) and of
`megatron-gspo export` (`run/test_export.py`): a tiny Qwen3-MoE folder, a run config over it, a
saved run to export."""

import os

import pytest

from megatron_gspo.cli import main as cli_main
from megatron_gspo.config.schema import config_to_dict, load_config
from megatron_gspo.run import checkpoint as ckpt
from tests.hf_fixtures import make_model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("qwen3"))
    make_model(folder, "qwen3_moe", seed=1)
    return folder


def run_config(hf_dir, run_dir, *extra):
    return load_config(None, [f"model.hf_path={hf_dir}", f"run_dir={run_dir}", "task.n_train=4",
                              "task.n_eval=2", "wandb.mode=disabled", *extra])


def save_run(policy, cfg, run_dir: str) -> None:
    """What megatron_gspo.run.resume.save_state writes and the export reads: the dist checkpoint
    and rank 0's config."""
    from moe.model import dist_ckpt

    root = os.path.join(run_dir, "checkpoints")
    dist_dir = os.path.join(ckpt.step_dir(root, 3), "dist")
    dist_ckpt.save(policy, dist_dir)
    for path in dist_ckpt.files_written_by(dist_dir, 0):  # every shard checksummed, as there
        ckpt.write_checksum(path)
    ckpt.save_checkpoint(root, 3, {"config": config_to_dict(cfg)})
    ckpt.mark_latest(root, 3)


def one_line(capsys, argv) -> str:
    """The one stderr line of a CLI call that exits 2."""
    capsys.readouterr()
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]
