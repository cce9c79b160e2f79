"""--plot-only before any run: each runner says what is missing in one line and exits non-zero,
with no traceback and nothing written (it went on to the table and raised)."""

import importlib
import os

import pytest


@pytest.mark.parametrize("name", ["ablation", "long_response", "routing_volatility",
                                  "replay_dose_response"])
def test_plot_only_on_absent_runs_is_one_line(tmp_path, monkeypatch, capsys, name):
    run = importlib.import_module(f"experiments.{name}.run")
    monkeypatch.setattr(run, "ROOT", str(tmp_path))
    monkeypatch.setattr(run, "HERE", str(tmp_path))
    with pytest.raises(SystemExit) as e:
        raise SystemExit(run.main(["--plot-only"]))
    out = capsys.readouterr()
    message = str(e.value.code) if isinstance(e.value.code, str) else out.err
    assert e.value.code not in (0, None)
    assert "Traceback" not in out.err and len(message.strip().splitlines()) == 1, message
    assert ("no metrics.jsonl" in message) or ("no calibration" in message)
    assert os.listdir(tmp_path) == []
