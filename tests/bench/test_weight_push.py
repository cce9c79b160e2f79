"""bench/weight_push.py: the in-process push and an engine server's push of one model, side by
side in one run, in seconds per GB with the server's ratio (a tiny model: the shape of the
report, no timed assertion)."""

import importlib.util
import re

import pytest

from bench import weight_push


def test_arguments_are_checked():
    with pytest.raises(SystemExit):
        weight_push.parse_args(["--tp", "0"])
    args = weight_push.parse_args([])
    assert args.tp == [2] and args.preset == "small" and args.settle_s > 0


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_in_process_and_server_pushes_in_one_report(capsys):
    assert weight_push.main(["--preset", "qwen3-moe-tiny-hd32", "--layers", "1", "--rounds", "1",
                             "--tp", "2", "--settle-s", "0"]) == 0
    out = capsys.readouterr().out
    size = re.search(r"pushed per round: (\d+\.\d) MiB \((\d+\.\d{3}) GB\)", out)
    assert size and float(size.group(1)) > 0, out
    for side in ("stream alone", "server, TP=2", "in-process"):
        assert re.search(rf"^\| {re.escape(side)} \| \d+\.\d{{3}} \| \d+\.\d\d \| \d+\.\d\d \|$",
                         out, flags=re.M), (side, out)
    assert re.search(r"^server, TP=2 / in-process \(median\): \d+\.\d\dx$", out, flags=re.M), out
