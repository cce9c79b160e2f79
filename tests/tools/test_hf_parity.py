"""tools/hf_parity.py on a tiny local Qwen3-MoE folder: its last line and exit status."""

import importlib.util
import os
import re

import pytest

from tests.hf_fixtures import make_model

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "hf_parity.py")
_spec = importlib.util.spec_from_file_location("hf_parity", _PATH)
hf_parity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf_parity)
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
