"""tools/replay_memory.py: the replay cache's byte formula, its table, the measured check."""

import dataclasses
import types

import pytest

from tools import replay_memory as rm


def test_cache_bytes_is_tokens_x_layers_x_topk_x_compact_itemsize():
    """10 tokens x 4 layers x top-2: 80 B as uint8 (<= 256 experts), 160 B as int16 (257)."""
    assert rm.cache_bytes(10, 4, 2, num_experts=16) == 80
    assert rm.cache_bytes(10, 4, 2, num_experts=256) == 80
    assert rm.cache_bytes(10, 4, 2, num_experts=257) == 160
    assert rm.cache_bytes(10, 4, 2, num_experts=16, itemsize=8) == 640  # as megatron records


def _row(text: str) -> list[str]:
    return text.splitlines()[2].split()


def test_table_row_for_qwen3_30b_by_hand():
    """128 prompts x G=16 x 2048 tokens = 4,194,304 tokens; x 48 layers x top-8 = 1,610,612,736
    B = 1.50 GiB as uint8 (128 experts), 6.00 as int32, 12.00 as int64; 0.375 GiB per rank at
    dp=4; at real lengths (rows of a quarter on average) 0.375 GiB, 0.094 per rank."""
    text = rm.table("qwen3-30b-a3b", [128], 16, [2048], dp=4)
    assert "L=48 layers, K=8 of E=128 experts, stored as uint8" in text.splitlines()[0]
    assert "per DP rank (dp=4) GiB" in text.splitlines()[1]
    assert _row(text) == ["128", "16", "2048", "4,194,304", "1.50", "6.00", "12.00", "0.375",
                          "0.38", "0.094"]  # rows a quarter of full length on average
    assert len(text.splitlines()) == 3


def test_table_has_a_row_per_prompt_count_and_sequence_length():
    """Rows run over prompts (outer) x tokens/seq (inner)."""
    lines = rm.table("qwen3-30b-a3b", [128, 512], 16, [2048, 8192], dp=64).splitlines()[2:]
    assert [ln.split()[:3] for ln in lines] == [["128", "16", "2048"], ["128", "16", "8192"],
                                               ["512", "16", "2048"], ["512", "16", "8192"]]


@pytest.mark.parametrize("experts,dtype,gib", [(256, "uint8", "0.19"), (257, "int16", "0.38")])
def test_table_switches_to_int16_above_256_experts(monkeypatch, experts, dtype, gib):
    """qwen3-30b-a3b with E experts, 16 prompts x G=16 x 2048 tokens = 524,288 tokens x 48 x 8 =
    201,326,592 ids: 0.1875 GiB as uint8, twice that as int16 (int32 0.75, int64 1.50)."""
    from moe.model import presets

    monkeypatch.setitem(presets.PRESETS, "wide-e", dataclasses.replace(
        presets.get_preset("qwen3-30b-a3b"), name="wide-e", num_experts=experts))
    text = rm.table("wide-e", [16], 16, [2048], dp=1)
    assert f"stored as {dtype};" in text.splitlines()[0]
    assert f"{dtype} GiB" in text.splitlines()[1]
    assert _row(text)[4] == gib and _row(text)[5:7] == ["0.75", "1.50"]


def test_median_time_is_the_median_of_the_repeats(monkeypatch):
    """Calls lasting 5, 1 and 3 s: the median is 3 (not the first, min or mean)."""
    clock = iter([0, 5, 10, 11, 20, 23])
    monkeypatch.setattr(rm, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    calls = []
    assert rm._median_time(lambda: calls.append(1), 3) == 3
    assert len(calls) == 3


def test_measure_checks_the_cache_of_a_ragged_batch_and_times_the_right_variants(monkeypatch):
    """batch 6 x seq 8, padding b % 5 on the left and b % 3 on the right: 8 + 6 + 4 + 5 + 3 + 6
    = 32 valid tokens x 4 layers x top-4 = 512 B as uint8 (4096 B as int64). A fake clock gives
    a train step 1 s, one with the recorded cache replayed 2 s, a routing measurement 0.5 s."""
    events = []
    real_replay, real_current = rm.replay_routing, rm.current_routing

    def replay_routing(policy, cache):
        events.append("replay" if cache is not None else "train")
        return real_replay(policy, cache)

    def current_routing(*a, **k):
        events.append("flip")
        return real_current(*a, **k)

    def fake_time(fn, repeats):
        events.clear()
        fn()
        return {"train": 1.0, "replay": 2.0, "flip": 0.5}[events[0]]

    monkeypatch.setattr(rm, "replay_routing", replay_routing)
    monkeypatch.setattr(rm, "current_routing", current_routing)
    monkeypatch.setattr(rm, "_median_time", fake_time)
    m = rm.measure(batch=6, seq=8, repeats=3)
    assert m["valid_tokens"] == 32
    assert m["measured_bytes"] == m["formula_bytes"] == 512
    assert m["int64_bytes"] == 4096
    assert (m["train_step_s"], m["replay_step_s"], m["flip_measure_s"]) == (1.0, 2.0, 0.5)
    assert (m["replay_time_ratio"], m["flip_time_ratio"]) == (2.0, 0.5)


_FAKE = {"valid_tokens": 32, "measured_bytes": 512, "formula_bytes": 512, "int64_bytes": 4096,
         "train_step_s": 0.01, "replay_step_s": 0.011, "flip_measure_s": 0.004,
         "replay_time_ratio": 1.1, "flip_time_ratio": 0.4}


def test_main_fails_when_the_measured_cache_disagrees_with_the_formula(monkeypatch, capsys):
    """A cache 1 byte larger than the formula (or smaller) is a failure, exit 1."""
    for measured in (513, 511):
        monkeypatch.setattr(rm, "measure", lambda: {**_FAKE, "measured_bytes": measured})
        assert rm.main(["--measure-only"]) == 1
        assert "DISAGREE" in capsys.readouterr().out
    monkeypatch.setattr(rm, "measure", lambda: dict(_FAKE))
    assert rm.main(["--measure-only"]) == 0
    out = capsys.readouterr().out
    assert "cache 512 B, formula 512 B -> agree; as int64 it would be 4096 B (8x)" in out
    assert "with replay x1.10" in out and "x0.40 of a train fwd+bwd" in out
    assert "Routing Replay cache for" not in out  # --measure-only: no table


def test_main_no_measure_prints_the_default_table_only(monkeypatch, capsys):
    """Defaults: qwen3-30b-a3b, G=16, 128/512 prompts x 2048/8192/32768 tokens, dp=64."""
    monkeypatch.setattr(rm, "measure", lambda: pytest.fail("--no-measure measured"))
    assert rm.main(["--no-measure"]) == 0
    out = capsys.readouterr().out
    assert out.strip() == rm.table("qwen3-30b-a3b", [128, 512], 16, [2048, 8192, 32768], 64)
