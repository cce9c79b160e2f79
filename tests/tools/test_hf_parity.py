"""tools/hf_parity.py on a tiny local Qwen3-MoE folder: its last line and exit status."""

import re

import pytest

from tests.hf_fixtures import make_model
from tools import hf_parity

LAST = re.compile(r"^max_abs_logit_diff=(\S+) greedy_match=(\S+)$")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("qwen3_parity"))
    make_model(folder, "qwen3_moe", seed=2, num_experts_per_tok=2)
    return folder


def run(capsys, *argv) -> tuple[int, float, float]:
    status = hf_parity.main(list(argv))
    last = capsys.readouterr().out.strip().splitlines()[-1]
    m = LAST.match(last)
    assert m, last
    return status, float(m.group(1)), float(m.group(2))


def test_matching_checkpoint_passes_and_a_tight_tolerance_fails(hf_dir, capsys):
    args = ["--hf-path", hf_dir, "--max-new-tokens", "6", "--prompt", "12+30=",
            "--prompt", "what is 7 plus 5?"]
    status, diff, match = run(capsys, *args)
    assert status == 0 and 0 < diff <= 1e-4 and match == 1.0
    status, diff2, _ = run(capsys, *args, "--tol", f"{diff / 2:.3e}")
    assert status == 1 and diff2 == diff


def test_greedy_match_counts_length_differences_as_misses():
    assert hf_parity.greedy_match([[1, 2, 3]], [[1, 2, 3]]) == 1.0
    assert hf_parity.greedy_match([[1, 2]], [[1, 5, 6, 7]]) == 0.25
    assert hf_parity.greedy_match([[1, 2], [3]], [[1, 2], [4]]) == 2 / 3


def test_bad_input_is_one_line_and_status_2_not_a_parity_failure(hf_dir, tmp_path, capsys):
    """Status 1 means "the checkpoint differs": a hub name, a folder without config.json, an
    unsupported family or a layout the config / world cannot split is status 2 and one line
    (were tracebacks with status 1)."""
    import json
    import shutil

    odd = tmp_path / "odd"
    shutil.copytree(hf_dir, odd)
    config = json.load(open(odd / "config.json"))
    (odd / "config.json").write_text(json.dumps({**config, "num_local_experts": 5}))
    (tmp_path / "mixtral").mkdir()
    (tmp_path / "mixtral" / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    cases = [(["--hf-path", "Qwen/Qwen3-30B-A3B"], "hub name"),
             (["--hf-path", str(tmp_path)], "no config.json"),
             (["--hf-path", str(tmp_path / "mixtral")], "model_type='mixtral' is not supported"),
             (["--hf-path", str(odd), "--ep", "2"], "num_experts=5 is not divisible by ep=2"),
             (["--hf-path", hf_dir, "--ep", "2"], "--ep 2: world size 1 is not divisible")]
    for argv, match in cases:
        assert hf_parity.main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("hf_parity: error: ") and match in err[0], err
