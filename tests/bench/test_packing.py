"""bench/packing.py: the two length points, the synthetic batch, the three sides alternating
(TRL on the batch's own ids), the peak memory child, the report."""

import json
import re
from importlib.util import find_spec

import pytest
import torch

from bench import packing


def test_long_tail_lengths_are_lognormal_with_a_quarter_of_the_maximum_as_mean():
    assert packing.response_lengths("equal", 5, 240, 1.0, 0) == [240] * 5
    lengths = packing.response_lengths("long tail", 4000, 240, 1.0, 0)
    assert 1 <= min(lengths) and max(lengths) == 240  # clipped to [1, max]
    assert 52 < sum(lengths) / len(lengths) < 62  # 60 before the clip trims the tail
    assert sorted(lengths)[len(lengths) // 2] < 45  # a long tail: the median far below the mean
    assert lengths == packing.response_lengths("long tail", 4000, 240, 1.0, 0)  # seeded


def test_synthetic_batch_rows_are_a_group_prompt_then_the_response_lengths():
    batch = packing.synthetic_batch([3, 1, 5, 2], prompt=4, vocab=20, group=2, seed=0)
    assert batch.tokens_BT.shape == (4, 9)
    assert batch.response_BT.sum(1).tolist() == [3, 1, 5, 2]
    assert batch.valid_BT.sum(1).tolist() == [7, 5, 9, 6]
    assert torch.equal(batch.tokens_BT[0, :4], batch.tokens_BT[1, :4])  # one prompt per group
    assert not torch.equal(batch.tokens_BT[0, :4], batch.tokens_BT[2, :4])
    real = batch.tokens_BT[batch.valid_BT]
    assert real.min() >= packing.FIRST_ID and real.max() < 20  # no pad / bos / eos inside


def test_bad_arguments_are_refused():
    for argv in (["--minibatches", "1"], ["--minibatches", "3"], ["--rounds", "0"],
                 ["--sigma", "0"], ["--budget", "-1"]):
        with pytest.raises(SystemExit):
            packing.parse_args(argv)
    assert packing.parse_args([]).budget == 4 * (16 + 240)


def test_padded_packed_and_trl_alternate_on_the_same_batch(capsys, monkeypatch):
    """One round per side at both points: our sides once per round at each point (and at TRL's
    generation boundaries at the long tail), TRL trained on the long-tail batch's own ids, the
    memory children asked once per side and point; the table has both points (TRL's columns
    where the bench extra is installed, else the line saying why not)."""
    ours, children = [], []
    real = packing.iteration
    monkeypatch.setattr(packing, "iteration", lambda trainer, batch: ours.append(
        (trainer.policy.pack, int(batch.valid_BT.sum()))) or real(trainer, batch))
    monkeypatch.setattr(packing, "peak_memory", lambda args, preset, pack, point: children.append(
        (pack, point)) or 1.0)
    assert packing.main(["--presets", "tiny", "--prompts", "2", "--group-size", "2",
                         "--max-new-tokens", "12", "--prompt-tokens", "4", "--rounds", "1",
                         "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    equal, tail = {n for _, n in ours[:2]}, {n for _, n in ours[2:]}
    assert len(ours) == 4 and equal == {4 * 16} and len(tail) == 1 and tail != equal
    assert [pack for pack, _ in ours] == [False, True] * 2
    assert children == [(False, "equal"), (True, "equal"), (False, "long tail"),
                        (True, "long tail")]
    assert re.search(r"\| tiny \| equal \| 12\.0 \| 64 \(64\) \| \d+ \| \d+ \| \d+\.\d\d \| 1 \| 1 "
                     r"\| - \| - \|", out)
    if all(find_spec(m) for m in ("trl", "datasets", "accelerate")):  # the bench extra
        trl = re.search(r"\| tiny \| long tail \|.* \| (\d+) \| (\d+\.\d\d) \|$", out, re.M)
        assert trl and int(trl.group(1)) > 0, out
    else:  # `make test`'s venv: TRL's side is said skipped, ours still measured
        assert re.search(r"\| tiny \| long tail \|.*\| - \| - \|$", out, re.M), out
        assert "TRL: skipped (" in out, out


def test_the_memory_child_reports_a_peak(monkeypatch, capsys):
    """`--child`: one side built and run twice, the second iteration's peak resident set."""
    args = packing.parse_args(["--prompts", "2", "--group-size", "2", "--max-new-tokens", "8",
                               "--prompt-tokens", "4", "--child",
                               json.dumps({"preset": "tiny", "pack": True, "point": "equal"})])
    assert packing.child(args) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["peak_mib"] >= 0
