"""tools/plot_load.py through tools.plot_run: expert_load.jsonl read back, the load heat map's
cells (each expert's share of its layer's mean load, layer-major) beside the run's per-layer
flip heat map, and a real PNG under 200 KB at a real model's size."""

import os

import numpy as np
import pytest

from tests.jsonl import write_jsonl, write_metrics
from tools import plot_load, plot_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(tmp_path, name="r", loads=None, flips=True) -> str:
    """A run dir: steps 2 and 4 of 2 layers x 3 experts (step 2 filed twice: the last row
    counts), and flip rates at steps 1..4 unless `flips` is False."""
    loads = loads or {2: [[3, 3, 0], [2, 2, 2]], 4: [[6, 0, 0], [1, 2, 3]]}
    rows = [{"step": t, "moe/flip_rate/layer_00": t / 10, "moe/flip_rate/layer_01": t / 20}
            for t in range(1, 5)] if flips else [{"step": 1, "reward/mean": 0.0}]
    d = write_metrics(tmp_path / name, rows)
    filed = [{"step": 2, "tokens": 1, "load": [[9, 9, 9], [9, 9, 9]]}]
    filed += [{"step": s, "tokens": 1, "load": load} for s, load in loads.items()]
    write_jsonl(os.path.join(d, "expert_load.jsonl"), filed)
    return d


def test_read_load_keeps_a_steps_last_row(tmp_path):
    steps, load_SLE = plot_load.read_load(_run(tmp_path))
    assert steps.tolist() == [2, 4] and load_SLE.shape == (2, 2, 3)
    assert load_SLE[0].tolist() == [[3, 3, 0], [2, 2, 2]]
    assert plot_load.read_load(write_metrics(tmp_path / "none", [{"step": 1}])) is None


@pytest.fixture
def saved(monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    out = {}
    monkeypatch.setattr(Figure, "savefig",
                        lambda fig, path, **kw: out.__setitem__(os.path.basename(path), fig))
    return out


def test_load_cells_are_shares_of_the_layer_mean_beside_the_flip_rates(tmp_path, saved):
    """Rows: layer 0's experts then layer 1's; columns: steps 2, 4. Layer 0 at step 4 sends
    everything to expert 0 (share 3); an expert with no token is clipped to the scale's 1/8.
    The right panel is the run's flip heat map (layer x step)."""
    runs = plot_run.load_runs([_run(tmp_path)])
    assert "expert_load.png" in map(os.path.basename,
                                    plot_run.make_figures(runs, str(tmp_path / "out")))
    left, right = saved["expert_load.png"].axes[:2]  # the colour bars' axes follow
    cells = np.asarray(left.collections[0].get_array()).reshape(6, 2)
    eighth = plot_load.SHARE_RANGE[0]
    np.testing.assert_allclose(cells[:, 0], [1.5, 1.5, eighth, 1, 1, 1])
    np.testing.assert_allclose(cells[:, 1], [3, eighth, eighth, 0.5, 1, 1.5])
    flips = np.asarray(right.collections[0].get_array()).reshape(2, 4)
    np.testing.assert_allclose(flips, [[.1, .2, .3, .4], [.05, .1, .15, .2]])


def test_a_run_without_flip_rates_says_so_and_one_without_the_file_is_skipped(tmp_path, saved,
                                                                             capsys):
    runs = plot_run.load_runs([_run(tmp_path, flips=False)])
    assert plot_run.make_figures(runs, str(tmp_path / "out"))
    right = saved["expert_load.png"].axes[1]
    assert [t.get_text() for t in right.texts] == ["no moe/flip_rate/layer_XX"]
    bare = plot_run.load_runs([write_metrics(tmp_path / "bare", [{"step": 1,
                                                                  "reward/mean": 1.0}])])
    written = plot_run.make_figures(bare, str(tmp_path / "out2"))
    assert "expert_load.png" not in map(os.path.basename, written)
    assert "skipping expert_load.png: no run has expert_load.jsonl" in capsys.readouterr().out


def test_a_real_size_figure_is_a_small_png(tmp_path, capsys):
    """48 layers x 128 experts (Qwen3-30B-A3B) over 60 steps: a PNG under 200 KB."""
    pytest.importorskip("matplotlib")
    rng = np.random.default_rng(0)
    loads = {s: rng.poisson(64, size=(48, 128)).tolist() for s in range(1, 61)}
    d = _run(tmp_path, "big", loads)
    assert plot_run.main([d, "--out", str(tmp_path / "figs")]) == 0
    png = tmp_path / "figs" / "expert_load.png"
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size < 200_000
