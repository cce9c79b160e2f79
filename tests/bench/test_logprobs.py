"""bench/logprobs.py: fresh children measure each arm's log-prob pass; the chunks of tokens
hold less than the plain float32 log-softmax at its peak."""

import re

from bench import logprobs as bench_logprobs


def test_both_arms_of_both_passes_are_measured_and_the_chunks_peak_lower(capsys, monkeypatch):
    """1 x 512 positions over 8,192 entries (16 MiB of float32 logits), chunks of 2^18
    elements (1 MiB): the loss pass's peak after is below before's (the plain path's float32
    log-softmax, its grads); a memory figure, not a timing."""
    arms = []
    real = bench_logprobs.measure
    monkeypatch.setattr(bench_logprobs, "measure",
                        lambda args, **arm: arms.append(arm) or real(args, **arm))
    bench_logprobs.main(["--seqs", "1", "--positions", "512", "--vocab", "8192", "--dtypes",
                         "fp32", "--rounds", "1", "--chunk-elements", str(1 << 18)])
    assert [(a["pass"], a["arm"]) for a in arms] == [("pi_old", "before"), ("pi_old", "after"),
                                                     ("loss", "before"), ("loss", "after")]
    out = capsys.readouterr().out
    row = re.search(r"\| loss \| fp32 \| (\d+) \| (\d+) \| (\d+\.\d\d) \|", out)
    assert row and int(row.group(2)) < int(row.group(1)) and float(row.group(3)) < 0.8, out
    assert re.search(r"\| pi_old \| fp32 \| \d+ \| \d+ \|", out)
