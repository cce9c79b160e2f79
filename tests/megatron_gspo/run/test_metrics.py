"""MetricsLogger JSONL output, resume-append, rank gating, Timer, progress line."""

import builtins
import json
import os

import numpy as np
import pytest
import torch

from megatron_gspo.run.metrics import MetricsLogger, Timer, format_progress, read_jsonl


def test_log_writes_one_flushed_line_per_call(tmp_path):
    logger = MetricsLogger(str(tmp_path), {"seed": 0})
    logger.log(1, {"reward/mean": 0.25, "policy/clip_frac/token": torch.tensor(0.5),
                   "train/iteration": np.int64(3), "moe/flip_rate/mean": np.float32(0.125)})
    # flushed: readable before close
    recs = read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))
    assert len(recs) == 1
    r = recs[0]
    assert r["step"] == 1 and isinstance(r["time"], float)
    assert r["reward/mean"] == 0.25 and r["policy/clip_frac/token"] == 0.5
    assert r["train/iteration"] == 3 and r["moe/flip_rate/mean"] == 0.125
    assert type(r["policy/clip_frac/token"]) is float
    logger.log(2, {"reward/mean": 0.5})
    logger.close()
    assert [r["step"] for r in read_jsonl(logger.path)] == [1, 2]


def test_non_finite_values_are_visible_strings(tmp_path):
    with MetricsLogger(str(tmp_path)) as logger:
        logger.log(0, {"a": float("nan"), "b": float("inf"), "c": -float("inf"),
                       "d": torch.tensor(float("nan"))})
    line = open(os.path.join(tmp_path, "metrics.jsonl")).read()
    rec = json.loads(line)  # strict JSON: no bare NaN tokens
    assert (rec["a"], rec["b"], rec["c"], rec["d"]) == ("nan", "inf", "-inf", "nan")
    assert "NaN" not in line and "null" not in line


def test_bad_metric_values_raise(tmp_path):
    with MetricsLogger(str(tmp_path)) as logger:
        with pytest.raises(ValueError, match="'x/vec'.*3 elements"):
            logger.log(0, {"x/vec": torch.ones(3)})
        with pytest.raises(ValueError, match="'x/list'"):
            logger.log(0, {"x/list": [1, 2]})
        with pytest.raises(ValueError, match="'step'"):
            logger.log(0, {"step": 1})


def test_a_file_of_lists_takes_nested_lists_of_numbers(tmp_path):
    """`lists=True` (expert_load.jsonl): nested lists of numbers, element by element, into
    another file; metrics.jsonl (above) refuses them."""
    with MetricsLogger(str(tmp_path), file="load.jsonl", lists=True) as logger:
        logger.log(2, {"load": [[1, torch.tensor(2.0)], [float("nan"), 0]]})
    row, = read_jsonl(os.path.join(tmp_path, "load.jsonl"))
    assert row["load"] == [[1, 2.0], ["nan", 0]] and row["step"] == 2
    assert not os.path.exists(os.path.join(tmp_path, "metrics.jsonl"))


def test_resume_appends_and_keeps_earlier_lines(tmp_path):
    with MetricsLogger(str(tmp_path)) as logger:
        logger.log(1, {"r": 1.0})
        logger.log(2, {"r": 2.0})
    with MetricsLogger(str(tmp_path)) as logger:
        logger.log(3, {"r": 3.0})
    assert [(r["step"], r["r"]) for r in read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))] \
        == [(1, 1.0), (2, 2.0), (3, 3.0)]


def test_partial_last_line_from_a_crash_is_kept_apart(tmp_path):
    path = os.path.join(tmp_path, "metrics.jsonl")
    with open(path, "w") as f:
        f.write('{"step": 1, "r": 1.0}\n{"step": 2, "r"')  # crashed mid-write
    assert read_jsonl(path) == [{"step": 1, "r": 1.0}]  # malformed last line skipped
    with MetricsLogger(str(tmp_path)) as logger:
        logger.log(3, {"r": 3.0})
    lines = open(path).read().splitlines()
    assert lines[1] == '{"step": 2, "r"' and json.loads(lines[2])["step"] == 3
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        read_jsonl(path)  # now a malformed line in the middle


def test_disabled_logger_is_a_no_op(tmp_path):
    logger = MetricsLogger(str(tmp_path / "rank1"), enabled=False, wandb_mode="online")
    logger.log(1, {"r": 1.0})
    logger.close()
    assert not os.path.exists(tmp_path / "rank1")


def test_wandb_missing_gives_install_hint(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(ImportError, match=r"pip install -e \.\[wandb\]"):
        MetricsLogger(str(tmp_path), wandb_mode="offline")
    with pytest.raises(ValueError, match="'offlin'"):
        MetricsLogger(str(tmp_path), wandb_mode="offlin")


def test_wandb_receives_numeric_metrics(tmp_path, monkeypatch):
    calls = []

    class FakeRun:
        def log(self, data, step):
            calls.append(("log", data, step))

        def finish(self):
            calls.append(("finish",))

    class FakeWandb:
        @staticmethod
        def init(**kwargs):
            calls.append(("init", kwargs["project"], kwargs["mode"], kwargs["config"]))
            return FakeRun()

    monkeypatch.setitem(__import__("sys").modules, "wandb", FakeWandb)
    logger = MetricsLogger(str(tmp_path), {"seed": 5}, wandb_mode="offline", project="p")
    logger.log(4, {"r": 0.5, "g": float("inf"), "note": "hi"})
    logger.close()
    assert calls[0] == ("init", "p", "offline", {"seed": 5})
    assert calls[1] == ("log", {"r": 0.5, "g": float("inf")}, 4)
    assert calls[2] == ("finish",)


def test_timer_accumulates_with_injected_clock():
    ticks = iter([10.0, 10.5, 20.0, 21.25, 30.0, 30.5])
    timer = Timer(clock=lambda: next(ticks))
    with timer("rollout"):
        pass
    with timer("train"):
        pass
    with timer("rollout"):
        pass
    assert timer.as_metrics() == {"time/rollout": 1.0, "time/train": 1.25}
    timer.reset()
    assert timer.as_metrics() == {}


def test_timer_records_on_exception():
    ticks = iter([0.0, 2.0])
    timer = Timer(clock=lambda: next(ticks))
    with pytest.raises(RuntimeError):
        with timer("x"):
            raise RuntimeError("boom")
    assert timer.as_metrics() == {"time/x": 2.0}


def test_format_progress():
    line = format_progress(3, 20, {"reward/mean": 0.41, "policy/clip_frac/token": 0.012,
                                   "train/grad_norm": torch.tensor(1.23456),
                                   "train/minibatch": 2},
                           ["reward/mean", "eval/accuracy", "policy/clip_frac/token",
                            "train/grad_norm", "train/minibatch"])
    assert line == ("[  3/20] reward/mean=0.41 policy/clip_frac/token=0.012 "
                    "train/grad_norm=1.235 train/minibatch=2")
    assert format_progress(12, 1000, {"x": float("nan")}, ["x"]) == "[  12/1000] x=nan"


def test_drop_after_keeps_rows_up_to_the_step(tmp_path):
    """Guards drop_after: rows with step <= the resumed step stay, later ones and a malformed
    (half-written) row go, the count is returned, and logging appends after the kept rows."""
    path = os.path.join(tmp_path, "metrics.jsonl")
    with open(path, "w") as f:
        f.write('{"step": 1, "r": 1.0}\n{"step": 2, "r": 2.0}\n\n{"step": 3, "r": 3.0}\n'
                '{"step": 4, "r"\n')
    with MetricsLogger(str(tmp_path)) as logger:
        assert logger.drop_after(2) == 2
        assert logger.drop_after(2) == 0
        logger.log(3, {"r": 30.0})
    assert [(r["step"], r["r"]) for r in read_jsonl(path)] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_values_keep_their_json_type_and_only_scalars_pass(tmp_path):
    """Integers (Python, numpy, bool) are written as JSON ints, floats as floats; a numpy array
    or a tensor with other than one element (empty included) raises, naming the key."""
    with MetricsLogger(str(tmp_path)) as logger:
        logger.log(np.int64(5), {"i": 3, "n": np.int64(4), "b": True, "t": torch.tensor(7),
                                 "f": 2.0})
        with pytest.raises(ValueError, match="'x/empty'.*0 elements"):
            logger.log(0, {"x/empty": torch.ones(0)})
        with pytest.raises(ValueError, match="'x/np'.*2 elements"):
            logger.log(0, {"x/np": np.array([1.0, 2.0])})
    rec = read_jsonl(logger.path)[0]
    assert {k: (v, type(v)) for k, v in rec.items() if k != "time"} == {
        "step": (5, int), "i": (3, int), "n": (4, int), "b": (1, int), "t": (7, int),
        "f": (2.0, float)}


def test_non_str_keys_and_logging_after_close_raise(tmp_path):
    """A non-str key is refused (JSON would silently turn 1 into "1"); `log` after `close` is
    a clear error, and a second `close` is harmless."""
    logger = MetricsLogger(str(tmp_path))
    with pytest.raises(ValueError, match="metric key 1"):
        logger.log(0, {1: 0.5})
    with pytest.raises(ValueError, match="'time'"):
        logger.log(0, {"time": 0.5})
    logger.close()
    logger.close()
    with pytest.raises(RuntimeError, match="closed"):
        logger.log(1, {"r": 1.0})


def test_wandb_is_finished_once_and_never_imported_when_disabled(tmp_path, monkeypatch):
    """`close` twice finishes the wandb run once; mode "disabled" never imports wandb."""
    from megatron_gspo.run import metrics

    finished = []
    fake = type("W", (), {"init": staticmethod(lambda **kw: type("R", (), {
        "finish": lambda self: finished.append(1)})())})
    monkeypatch.setattr(metrics, "_import_wandb", lambda mode: fake)
    logger = MetricsLogger(str(tmp_path), wandb_mode="offline")
    logger.close()
    logger.close()
    assert finished == [1]

    def no_import(mode):
        raise AssertionError("wandb imported in disabled mode")

    monkeypatch.setattr(metrics, "_import_wandb", no_import)
    MetricsLogger(str(tmp_path), wandb_mode="disabled").close()


def test_new_nested_run_dir_and_empty_existing_file(tmp_path):
    """The run dir is created (nested); an existing empty metrics.jsonl (a crash before the
    first row) is appended to as is, with no leading blank line."""
    run_dir = tmp_path / "a" / "b"
    with MetricsLogger(str(run_dir)) as logger:
        logger.log(1, {"r": 1.0})
    assert [r["step"] for r in read_jsonl(logger.path)] == [1]
    open(tmp_path / "metrics.jsonl", "w").close()
    with MetricsLogger(str(tmp_path)) as logger:
        assert logger.drop_after(0) == 0
        logger.log(2, {"r": 2.0})
    assert json.loads(open(logger.path).read().splitlines()[0])["step"] == 2


def test_drop_after_on_a_disabled_logger_and_rows_without_a_step(tmp_path):
    """A disabled logger (another rank) drops nothing and touches no file; a row that parses
    but has no "step" (an object without it, or not an object) counts as malformed and goes."""
    assert MetricsLogger(str(tmp_path / "rank1"), enabled=False).drop_after(0) == 0
    path = os.path.join(tmp_path, "metrics.jsonl")
    with open(path, "w") as f:
        f.write('{"step": 1, "r": 1.0}\n{"r": 2.0}\n[3]\n{"step": 2, "r": 2.0}\n')
    with MetricsLogger(str(tmp_path)) as logger:
        assert logger.drop_after(5) == 2
    assert [r["step"] for r in read_jsonl(path)] == [1, 2]


def test_read_jsonl_skips_blank_lines_anywhere(tmp_path):
    """Blank lines between rows are not malformed rows."""
    path = os.path.join(tmp_path, "m.jsonl")
    with open(path, "w") as f:
        f.write('{"step": 1}\n\n   \n{"step": 2}\n\n')
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]


def test_wandb_reachability_probe_uses_the_schemes_default_port(monkeypatch):
    """No port in the URL: 443 for https (the default https://api.wandb.ai), 80 for http."""
    import socket

    from megatron_gspo.run.metrics import _online_or_offline

    seen = []

    class Conn:
        def close(self):
            pass

    monkeypatch.setattr(socket, "create_connection",
                        lambda address, timeout: seen.append(address) or Conn())
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    assert _online_or_offline() == "online"
    monkeypatch.setenv("WANDB_BASE_URL", "http://wandb.example")
    assert _online_or_offline() == "online"
    assert seen == [("api.wandb.ai", 443), ("wandb.example", 80)]


def test_timer_section_names_are_checked():
    timer = Timer(cuda_sync=False)
    for bad in ("", None, 3):
        with pytest.raises(ValueError, match="non-empty str"):
            with timer(bad):
                pass
    assert timer.as_metrics() == {}


def test_timer_syncs_cuda_at_both_ends_unless_told_not_to(monkeypatch):
    """With CUDA initialised, a section synchronises before starting and before stopping the
    clock (so GPU work launched inside is counted); `cuda_sync=False` never synchronises."""
    events = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: events.append("sync"))
    ticks = iter([0.0, 1.0])
    timer = Timer(clock=lambda: events.append("clock") or next(ticks))
    with timer("x"):
        events.append("body")
    assert events == ["sync", "clock", "body", "sync", "clock"]
    events.clear()
    ticks = iter([0.0, 1.0])
    with Timer(clock=lambda: next(ticks), cuda_sync=False)("x"):
        pass
    assert events == []


def test_format_progress_prints_integers_whole():
    """Integer values (and bools) print exactly, not in 4 significant digits."""
    line = format_progress(1, 2, {"n": 123456, "t": np.int64(98765), "b": True}, ["n", "t", "b"])
    assert line == "[  1/2] n=123456 t=98765 b=1"
