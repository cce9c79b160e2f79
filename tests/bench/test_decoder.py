"""bench/decoder.py runs both decoders on one trainer and reports their ratio."""

import re

from bench import decoder as bench_decoder


def test_both_decoders_run_and_the_ratio_is_reported(capsys, monkeypatch):
    used = []
    real = bench_decoder.build_ours

    def spy(*args, **kwargs):
        trainer, overrides = real(*args, **kwargs)
        real_rollout = trainer.rollout
        trainer.rollout = lambda it: used.append(trainer.policy.decoder) or real_rollout(it)
        return trainer, overrides

    monkeypatch.setattr(bench_decoder, "build_ours", spy)
    assert bench_decoder.main(["--max-new-tokens", "2", "--rounds", "1", "--prompts", "2",
                               "--group-size", "2"]) == 0
    assert used == ["lean", "megatron"] * 2  # warm-up round + 1 measured, alternating
    out = capsys.readouterr().out
    assert re.search(r"\| lean \| \d+\.\d{3} \| \d+\.\d{3} \|", out)
    assert re.search(r"megatron / lean \(best\): \d+\.\d\dx", out)
