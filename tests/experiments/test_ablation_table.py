"""experiments/ablation/run.py writes its result table (tools/result_table.py) into the README's
markers, headed by the machine and the cold start's band record."""

import json
import os

from experiments.ablation import run as ablation_run


def _write(d, records):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return str(d)


def test_write_table_into_readme_markers(tmp_path, monkeypatch, capsys):
    sft = _write(tmp_path / "sft", [{"step": 0, "eval/accuracy": 0.01},
                                    {"step": 870, "eval/accuracy": 0.2578,
                                     "sft/start_accuracy": 0.2578, "sft/band_step": 870.0}])
    runs = [_write(tmp_path / f"{arm}_s{s}", [
        {"step": 0, "eval/accuracy": 0.2578},
        {"step": 1, "policy/clip_frac/token": clip + s / 100, "moe/flip_rate/layer_00": 0.001},
        {"step": 2, "eval/accuracy": 0.3 + s / 10}]) for arm, clip in (("gspo", 0.2), ("grpo", 0.01))
        for s in (0, 1)]
    (tmp_path / "README.md").write_text("a\n<!-- table:main:begin -->\nstale\n"
                                        "<!-- table:main:end -->\nb\n")
    monkeypatch.setattr(ablation_run, "HERE", str(tmp_path))
    ablation_run.write_table(runs, "main", sft)
    text = (tmp_path / "README.md").read_text()
    assert "stale" not in text and text.startswith("a\n<!-- table:main:begin -->\nMeasured on ")
    assert f"Cold start {sft}: start accuracy 0.2578, entered the band at SFT step 870." in text
    assert "| eval accuracy at the start (SFT checkpoint) | 0.258 ± 0 | 0.258 ± 0 |" in text
    assert "| eval accuracy, final | 0.35 ± 0.071 | 0.35 ± 0.071 |" in text
    assert "| clipped tokens | 0.205 ± 0.0071 | 0.015 ± 0.0071 |" in text
    assert "| flip rate, layer 0 | 0.001 ± 0 | 0.001 ± 0 |" in text
    assert "| policy entropy | - | - |" in text and text.endswith("<!-- table:main:end -->\nb\n")
    ablation_run.write_table(runs, "stress", sft)  # no markers for this variant: printed
    assert "note: " in capsys.readouterr().out and (tmp_path / "README.md").read_text() == text
