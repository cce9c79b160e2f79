"""tools/plot_run.py figures: which numbers each panel draws (figures captured, not rendered)."""

import os

import numpy as np
import pytest

from tests.jsonl import write_metrics
from tools import plot_run


def _arm(tmp_path):
    """Arm g, two seeds, steps 0..3. reward s0 0,1,2,3 / s1 2,3,4,5; clip s0 0, .2, .1, .4 /
    s1 0, 0, .3, .2; eval at 0, 2: s0 .1, .3 / s1 .3, .5; layer_00 s0 .1..(+.1)..4 / s1 .3..6;
    layer_01 = .5 in s0 only; moe/flip_rate/mean = layer_00."""
    def seed(reward, clip, evals, layer0, layer1=None):
        recs = [{"step": t, "reward/mean": reward[t], "policy/clip_frac/token": clip[t],
                 "moe/flip_rate/layer_00": layer0[t], "moe/flip_rate/mean": layer0[t],
                 **({} if layer1 is None else {"moe/flip_rate/layer_01": layer1})}
                for t in range(4)]
        return recs + [{"step": t, "eval/accuracy": a} for t, a in zip((0, 2), evals)]

    return [write_metrics(tmp_path / "g_s0", seed([0, 1, 2, 3], [0, .2, .1, .4], [.1, .3],
                                                  [.1, .2, .3, .4], layer1=.5)),
            write_metrics(tmp_path / "g_s1", seed([2, 3, 4, 5], [0, 0, .3, .2], [.3, .5],
                                                  [.3, .4, .5, .6]))]


@pytest.fixture
def figs(tmp_path, monkeypatch):
    """make_figures(smooth 2) on _arm, returning {file name: Figure} instead of PNGs."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    saved = {}
    monkeypatch.setattr(Figure, "savefig",
                        lambda fig, path, **kw: saved.__setitem__(os.path.basename(path), fig))
    runs = plot_run.load_runs(_arm(tmp_path), group_by_prefix=True)
    written = plot_run.make_figures(runs, str(tmp_path / "out"), smooth_n=2)
    assert sorted(map(os.path.basename, written)) == sorted(saved)
    return saved


def _line(fig):
    (line,) = fig.axes[0].lines
    return line.get_xdata().tolist(), line.get_ydata().tolist()


def test_reward_is_the_smoothed_seed_mean(figs):
    """reward.png: the seed mean per step, moving-averaged over --smooth points."""
    x, y = _line(figs["reward.png"])
    assert x == [0, 1, 2, 3] and y == pytest.approx([1.0, 1.5, 2.5, 3.5])


def test_eval_accuracy_is_not_smoothed(figs):
    """eval_accuracy.png: the raw seed mean at each eval step (--smooth does not apply)."""
    x, y = _line(figs["eval_accuracy.png"])
    assert x == [0, 2] and y == pytest.approx([0.2, 0.4])


def test_clip_fraction_log_plot_drops_nonpositive_points(figs):
    """clip_fraction.png (log y): zero means leave the line, zero minima leave the band."""
    x, y = _line(figs["clip_fraction.png"])  # smoothed mean 0, .05, .15, .25
    assert x == [1, 2, 3] and y == pytest.approx([0.05, 0.15, 0.25])
    (band,) = figs["clip_fraction.png"].axes[0].collections  # smoothed min 0, 0, .05, .15
    verts = np.concatenate([p.vertices for p in band.get_paths()])
    assert set(verts[:, 0].round(6)) == {2.0, 3.0} and verts[:, 1].min() > 0


def test_flip_vs_depth_uses_layers_every_seed_has(figs):
    """flip_vs_depth.png: per-layer mean over steps, averaged over seeds, on common layers."""
    x, y = _line(figs["flip_vs_depth.png"])  # layer 0: s0 .25, s1 .45; layer 1 only in s0
    assert x == [0] and y == pytest.approx([0.35])
    (band,) = figs["flip_vs_depth.png"].axes[0].collections  # min-max over the seeds
    verts = np.concatenate([p.vertices for p in band.get_paths()])
    assert (verts[:, 1].min(), verts[:, 1].max()) == pytest.approx((0.25, 0.45))


def test_flip_rate_mean_is_smoothed(figs):
    """flip_rate_mean.png: the seed-mean flip rate, moving-averaged over --smooth points."""
    x, y = _line(figs["flip_rate_mean.png"])  # seed mean .2 .3 .4 .5
    assert x == [0, 1, 2, 3] and y == pytest.approx([0.2, 0.25, 0.35, 0.45])


def test_flip_heatmap_grid_and_colour_scale(figs):
    """flip_rate_layers.png: the seed-mean flip rate per (layer, step); colour scale 0..max."""
    fig = figs["flip_rate_layers.png"]
    mesh = fig.axes[0].collections[0]
    grid = np.ma.masked_invalid(mesh.get_array()).reshape(2, 4)
    np.testing.assert_allclose(grid[0].filled(np.nan), [0.2, 0.3, 0.4, 0.5])
    assert grid[1].mask.all()  # layer_01 is not logged by every seed
    assert mesh.get_clim() == pytest.approx((0.0, 0.5))


def test_flip_heatmap_places_layers_and_steps_with_gaps(tmp_path, monkeypatch):
    """Heatmap rows follow the logged layer indices (0, 3) and columns the union of steps."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, **kw: saved.append(fig))
    d = write_metrics(tmp_path / "k", [{"step": 0, "moe/flip_rate/layer_00": .1},
                                       {"step": 1, "moe/flip_rate/layer_00": .2,
                                        "moe/flip_rate/layer_03": .3},
                                       {"step": 2, "moe/flip_rate/layer_03": .4}])
    assert plot_run.plot_flip_heatmap(plot_run.load_runs([d]), str(tmp_path / "h.png"))
    mesh = saved[0].axes[0].collections[0]
    grid = np.ma.masked_invalid(mesh.get_array()).reshape(2, 3)
    np.testing.assert_allclose(grid.filled(-1), [[.1, .2, -1], [-1, .3, .4]])
    edges = mesh.get_coordinates()  # cells centred on steps 0, 1, 2 (x) and layers 0, 3 (y)
    np.testing.assert_allclose(edges[0, :, 0], [-0.5, 0.5, 1.5, 2.5])
    np.testing.assert_allclose(edges[:, 0, 1], [-1.5, 1.5, 4.5])


def test_single_run_line_has_no_band_and_clip_axis_is_log(tmp_path, monkeypatch):
    """One seed draws a bare line (no min-max band); the clip-fraction axis is logarithmic."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, **kw: saved.append(fig))
    d = write_metrics(tmp_path / "one", [{"step": t, "policy/clip_frac/token": 0.1 * (t + 1)}
                                         for t in range(3)])
    assert plot_run.plot_lines(plot_run.load_runs([d]), "policy/clip_frac/token",
                               str(tmp_path / "c.png"), "clip", logy=True)
    ax = saved[0].axes[0]
    assert len(ax.lines) == 1 and not ax.collections and ax.get_yscale() == "log"
