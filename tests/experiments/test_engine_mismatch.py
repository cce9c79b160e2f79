"""experiments/engine_mismatch/run.py: the per-run distillation of metrics.jsonl into results/,
the README report regenerated from fixture results alone, the runs' commands (random vs SFT
init, resume, skip when a result exists) and the configs' like-with-like arms."""

import json
import os

import pytest

from experiments.engine_mismatch import run as em
from megatron_gspo.config.schema import load_config
from tests.jsonl import write_metrics

HERE = em.HERE
MACHINE = "Measured on Test CPU, 2026-01-01, torch 0, megatron-core 0."


def _measure(shape, init, dtype, routers, any_layer, logprob):
    layers = 4 if shape == em.SHAPES[0] else 12
    return {"shape": shape, "init": init, "engine_dtype": dtype, "batches": 16,
            "start_accuracy": None if init == "random" else 0.27,
            "routers_per_layer": [routers * (0.5 + i / (layers - 1)) for i in range(layers)],
            "routers": routers, "any_layer": any_layer, "experts": routers / 3,
            "experts_all_tokens": routers / 3, "logprob_mean": logprob,
            "logprob_max": 10 * logprob, "probe_max": logprob, "weight_sync_s": 0.2,
            "wall_s": 120.0, "machine": MACHINE}


def _ablation(arm, seed, lr0, clip, acc):
    return {"arm": arm, "seed": seed, "batches": 30, "clip_token": clip, "clip_seq": clip,
            "clip_token_first": clip / 2, "log_ratio_first": lr0, "log_ratio_later": 0.05,
            "acc_start": 0.27, "acc_final": acc, "acc_best": acc + 0.01,
            "reward_first": 0.3, "reward_last": 0.4, "routers": 0.02, "any_layer": 0.07,
            "logprob_mean": 0.02, "logprob_r3_mean": 0.005 if arm == "grpo_r3" else None,
            "logprob_mean_max": 0.03 + seed / 100 + (arm == "gspo") / 1000, "probe_max": 2.5,
            "flip_rate": 0.003, "wall_s": 600.0, "machine": MACHINE,
            "series": {"log_ratio_first": [lr0] * 30, "clip_token_first": [clip / 2] * 30,
                       "eval": [[0, 0.27], [40, acc], [80, acc], [120, acc]]}}


def _fixture(tmp_path) -> em.Layout:
    lay = em.Layout(root=str(tmp_path), here=str(tmp_path))
    recs = {"sft": [{"shape": s, "start_accuracy": 0.2734, "band_step": 800.0, "span_s": 300.0,
                     "machine": MACHINE} for s in em.SHAPES],
            "measure": [_measure(s, i, d, 0.0 if d == "fp32" else r, 0.0 if d == "fp32" else a,
                                 5e-8 if d == "fp32" else 0.02)
                        for s, r, a in ((em.SHAPES[0], 0.02, 0.07), (em.SHAPES[1], 0.025, 0.2))
                        for i in em.INITS for d in em.DTYPES],
            "ablation": [_ablation(arm, seed, lr0 + seed / 1000, clip, acc + seed / 100)
                         for arm, lr0, clip, acc in (("gspo", 0.02, 0.9, 0.28),
                                                     ("grpo", 0.02, 0.01, 0.33),
                                                     ("grpo_r2", 0.02, 0.01, 0.32),
                                                     ("grpo_r3", 0.005, 0.008, 0.33),
                                                     ("grpo_fp32", 1e-6, 0.01, 0.35))
                         for seed in (0, 1, 2)]}
    for part, rows in recs.items():
        for r in rows:
            name = r["shape"] if part == "sft" else \
                em.measure_name(r["shape"], r["init"], r["engine_dtype"]) \
                if part == "measure" else f"{r['arm']}_s{r['seed']}"
            em._write(lay.result(part, name), r)
    return lay


def _readme(tmp_path) -> str:
    path = tmp_path / "README.md"
    path.write_text("top\n" + "".join(f"<!-- table:{m}:begin -->\nOLD\n<!-- table:{m}:end -->\n"
                                      for m in ("mismatch", "ablation", "answers", "runtime"))
                    + "bottom\n")
    return str(path)


def test_report_regenerates_every_table_from_results(tmp_path):
    lay, readme = _fixture(tmp_path), _readme(tmp_path)
    assert em.report(lay, readme) == 0
    text = open(readme).read()
    assert "OLD" not in text and text.startswith("top\n") and text.endswith("bottom\n")
    # part 1: one row per shape x init x engine, per-layer values from layer 0
    assert ("| `qwen3-moe-tiny-hd32` (4 x 16 experts, top-4) | sft | bf16 | 0.270 | 2.00% | "
            "1.0% 1.7% 2.3% 3.0% | 7.00% | 0.67% | 2.00e-02 | 2.00e-01 | 2.00e-02 | 16 |") in text
    assert "| `qwen3-moe-tiny-hd32-wide` (12 x 64 experts, top-4) | random | fp32 | - | 0.00% |" \
        in text
    assert "qwen3-moe-tiny-hd32: held-out accuracy 0.2734 (our float32 decoder), entered the " \
        "band at SFT step 800" in text
    # part 2: mean ± 95% t interval over 3 seeds (t = 4.303, sd of 0, 1, 2 thousandths = 1e-3)
    assert "| GSPO (3 seeds) | GRPO (3 seeds) | GRPO + R2 (3 seeds) | GRPO + R3 (3 seeds) | " \
        "GRPO, fp32 engine (3 seeds) |" in text
    assert "| first-minibatch abs log-ratio (trainer vs engine) | 0.0210 ± 0.0025 | " \
        "0.0210 ± 0.0025 | 0.0210 ± 0.0025 | 0.0060 ± 0.0025 | 0.0010 ± 0.0025 |" in text
    assert "| abs log-prob diff, engine vs trainer under R3's replay | - | - | - | " \
        "0.0050 ± 0.0000 | - |" in text
    # the answers: paired by seed, the R3 paper's figures side by side
    assert ("| GRPO + R3 − GRPO (what replaying the engine's routing changes) | "
            "-0.0150 ± 0.0000 * | -0.0010 ± 0.0000 * | -0.0020 ± 0.0000 * | 0.000 ± 0.000 |") \
        in text
    assert ("| GRPO − GRPO with an fp32 engine (what the bf16 mismatch changes) | "
            "0.0200 ± 0.0000 * |") in text and "-0.020 ± 0.000 * |" in text
    assert "GRPO with our decoder" not in text  # no such arm in the fixture: no row
    assert "replay removes 75% of the mismatch" in text
    assert "- final held-out accuracy, mean over seeds: from 0.290 (GSPO) to 0.360 (GRPO, fp32 " \
        "engine), against a start of 0.270 to 0.270; the best eval of any run is 0.380" in text
    assert "the largest per-batch mean |engine - trainer| log-prob of the sampled tokens is " \
        "0.0510 nats (GSPO, seed 2;" in text and "greedy continuation of a fixed prompt) reached 2.50 nats, over the bfloat16 default 0.8" \
        in text
    assert "- bfloat16 engine, `qwen3-moe-tiny-hd32`, sft init: 2.00% of routers differ " \
        "(layers 1.00% to 3.00%; shallowest third of the layers 1.00%, deepest third 3.00%), " \
        "5.0x fewer than the R3 paper's ~10%; 7.00% of tokens differ " \
        "in at least one layer (paper: 94%)" in text
    assert "- float32 engine: no router differs in any of its measurements, and the sampled " \
        "tokens' log-probs agree within 5.0e-07 nats" in text
    # the run block: the machine the results recorded, the summed run times
    assert MACHINE + " Run time per run summed (SFT (first to last metrics record): 2 runs, 10 min; measurements: 8 runs, " \
        "16 min; RL arms: 15 runs, 150 min)" in text
    for png in ("mismatch_per_layer.png", "ablation.png"):
        size = os.path.getsize(os.path.join(lay.figures, png))
        assert 0 < size < 200_000


def test_report_without_results_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(em, "ROOT", str(tmp_path))
    monkeypatch.setattr(em, "HERE", str(tmp_path))
    assert em.main(["--plot-only"]) == 2
    err = capsys.readouterr().err
    assert "no results in" in err and len(err.strip().splitlines()) == 1
    assert os.listdir(tmp_path) == []


def test_changed_runs_need_a_tag(capsys):
    with pytest.raises(SystemExit):
        em.main(["--steps", "3"])
    assert "give them a --tag" in capsys.readouterr().err


def test_summaries_read_the_first_minibatch_of_each_rollout_batch(tmp_path):
    """Rollout-batch metrics repeat on every minibatch's record; the summaries take minibatch
    0's, the ratio's later minibatches separately, the eval at step 0 as the start."""
    rows = [{"step": 0, "eval/accuracy": 0.26}]
    for it in range(2):
        for m in range(4):
            rows.append({"step": 4 * it + m + 1, "train/minibatch": m,
                         "rollout/routing_mismatch/layer_00": 0.01 * (it + 1),
                         "rollout/routing_mismatch/layer_01": 0.03 * (it + 1),
                         "rollout/routing_mismatch/mean": 0.02 * (it + 1),
                         "rollout/routing_any_diff": 0.05, "rollout/logprob_mismatch/mean": 0.01,
                         "rollout/logprob_mismatch/max": 0.1 * (it + 1),
                         "time/weight_sync": 0.5 - 0.2 * it, "reward/mean": 0.1 * it,
                         "policy/log_ratio/abs_mean": 0.02 if m == 0 else 0.06,
                         "policy/clip_frac/token": 0.0 if m == 0 else 0.4})
    rows[-1]["eval/accuracy"] = 0.3
    path = os.path.join(write_metrics(tmp_path / "r", rows), "metrics.jsonl")
    meas = em.summarize_measure(path)
    assert meas["batches"] == 2 and meas["start_accuracy"] == 0.26
    assert meas["routers_per_layer"] == pytest.approx([0.015, 0.045])
    assert meas["routers"] == pytest.approx(0.03) and meas["logprob_max"] == pytest.approx(0.2)
    assert meas["weight_sync_s"] == pytest.approx(0.3)  # the first push (engine start) left out
    abl = em.summarize_ablation(path)
    assert abl["log_ratio_first"] == pytest.approx(0.02)
    assert abl["log_ratio_later"] == pytest.approx(0.06)
    assert abl["clip_token"] == pytest.approx(0.3) and abl["clip_token_first"] == 0.0
    assert (abl["acc_start"], abl["acc_final"], abl["acc_best"]) == (0.26, 0.3, 0.3)
    assert abl["series"]["eval"] == [[0, 0.26], [8, 0.3]] and abl["logprob_r3_mean"] is None


def _stub_py(monkeypatch, calls):
    """py() records its command and writes a metrics.jsonl into the run_dir it names."""
    def fake(args, log):
        calls.append(args)
        run_dir = next(a.split("=", 1)[1] for a in args if a.startswith("run_dir="))
        write_metrics(os.path.join(em.ROOT, run_dir), [
            {"step": 1, "train/minibatch": 0, "rollout/routing_mismatch/mean": 0.1,
             "rollout/routing_mismatch/layer_00": 0.1}])
        return 1.0
    monkeypatch.setattr(em, "py", fake)


def test_measurement_commands_and_skip_when_a_result_exists(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(em, "ROOT", str(tmp_path))
    _stub_py(monkeypatch, calls)
    lay = em.Layout("t", root=str(tmp_path), here=str(tmp_path))
    em.measure_job(lay, em.SHAPES[1], "random", "bf16", 3, ["optim.lr=0"])
    em.measure_job(lay, em.SHAPES[1], "sft", "fp32", None, [])
    em.measure_job(lay, em.SHAPES[1], "sft", "fp32", None, [])  # has a result: not run again
    assert len(calls) == 2
    assert calls[0][:4] == ["megatron_gspo.cli", "train", "--config",
                            os.path.join(HERE, "measure.yaml")]
    assert calls[0][4:] == [f"model.preset={em.SHAPES[1]}", "rollout.vllm.dtype=bf16",
                            "init_checkpoint=null",
                            f"run_dir=runs/engine_mismatch_t/measure/{em.SHAPES[1]}_random_bf16",
                            "resume=false", "train.steps=3", "optim.lr=0"]
    assert f"init_checkpoint=runs/engine_mismatch/{em.SHAPES[1]}/sft" in calls[1]
    with open(lay.result("measure", f"{em.SHAPES[1]}_random_bf16")) as f:
        rec = json.load(f)
    assert (rec["engine_dtype"], rec["routers"], rec["wall_s"]) == ("bf16", 0.1, 1.0)


def test_an_ablation_arm_a_signal_stopped_resumes(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(em, "ROOT", str(tmp_path))
    _stub_py(monkeypatch, calls)
    lay = em.Layout(root=str(tmp_path), here=str(tmp_path))
    stopped = tmp_path / "runs/engine_mismatch/ablation/grpo_r3_s1/checkpoints"
    stopped.mkdir(parents=True)
    (stopped / "latest").write_text("10\n")
    em.ablation_job(lay, "grpo_r3", 1, None, [])
    em.ablation_job(lay, "grpo", 1, None, [])
    assert "resume=false" not in calls[0] and "resume=false" in calls[1]
    assert calls[0][3] == os.path.join(HERE, "grpo_r3.yaml") and "seed=1" in calls[0]
    assert f"init_checkpoint=runs/engine_mismatch/{em.SHAPES[0]}/sft" in calls[1]


def test_arms_differ_only_in_the_loss_and_replay():
    from megatron_gspo.rollout.vllm.engine import CPU_HEAD_DIMS
    from moe.model.presets import get_preset
    from tests.experiments.test_configs import config_diff as _diff

    cfgs = {arm: load_config(os.path.join(HERE, f"{arm}.yaml")) for arm in em.ARMS}
    assert _diff(cfgs["gspo"], cfgs["grpo"]) == {"run_dir", "loss.name", "loss.eps_low",
                                                 "loss.eps_high"}
    for arm in ("grpo_r2", "grpo_r3"):
        assert _diff(cfgs["grpo"], cfgs[arm]) == {"run_dir", "train.routing_replay"}
    # the controls: the same GRPO without the bfloat16 engine's mismatch
    assert _diff(cfgs["grpo"], cfgs["grpo_fp32"]) == {"run_dir", "rollout.vllm.dtype"}
    assert _diff(cfgs["grpo"], cfgs["grpo_lean"]) == {"run_dir", "rollout.backend",
                                                      "rollout.vllm.dtype"}
    assert (cfgs["grpo_fp32"].rollout.vllm.dtype, cfgs["grpo_lean"].rollout.backend) == \
        ("fp32", "lean")
    assert cfgs["grpo_fp32"].rollout.vllm.push_check_tol is None  # the float32 default guard
    for arm, c in cfgs.items():
        if arm not in ("grpo_fp32", "grpo_lean"):
            assert (c.rollout.backend, c.rollout.vllm.dtype) == ("vllm", "bf16")
            assert c.rollout.vllm.push_check_tol is None  # the bfloat16 default guard
        assert c.model.dtype == "fp32"
        assert c.rollout.use_sampler_logprobs and c.train.num_minibatches == 4
        assert c.model.preset == em.SHAPES[0] and c.train.start_accuracy == [0.25, 0.45]
    measure = load_config(os.path.join(HERE, "measure.yaml"))
    sft = load_config(os.path.join(HERE, "sft.yaml"))
    assert (measure.rollout.backend, measure.model.preset, sft.model.preset) == \
        ("vllm", em.SHAPES[0], em.SHAPES[0])
    assert sft.sft.target_accuracy == [0.25, 0.45] and measure.train.start_accuracy is None
    assert measure.train.eval_every == measure.train.steps  # the engine's accuracy, start + end
    assert all(get_preset(s).kv_channels in CPU_HEAD_DIMS for s in em.SHAPES)


def test_collect_distills_results_again_keeping_wall_time_and_machine(tmp_path, monkeypatch):
    monkeypatch.setattr(em, "ROOT", str(tmp_path))
    lay = em.Layout(root=str(tmp_path), here=str(tmp_path))
    em._write(lay.result("ablation", "grpo_s0"), {"arm": "grpo", "seed": 0, "wall_s": 7.0,
                                                  "machine": MACHINE, "stale": 1})
    em._write(lay.result("ablation", "gspo_s0"), {"arm": "gspo", "seed": 0, "wall_s": 8.0})
    write_metrics(tmp_path / "runs/engine_mismatch/ablation/grpo_s0", [
        {"step": 1, "train/minibatch": 0, "policy/log_ratio/abs_mean": 0.02}])
    assert em.collect(lay) == 1  # gspo_s0 has no run left: kept as it was
    with open(lay.result("ablation", "grpo_s0")) as f:
        rec = json.load(f)
    assert (rec["wall_s"], rec["machine"], rec["log_ratio_first"]) == (7.0, MACHINE, 0.02)
    assert "stale" not in rec


def test_the_cold_start_line_names_the_sft_run_and_step_where_recorded():
    """results/sft written since the cold start was recorded carry the SFT run's fingerprint,
    its checkpoint step and test accuracy; older ones give the line they always did."""
    from experiments.engine_mismatch.report import sft_line

    old = {"shape": "s", "start_accuracy": 0.2734, "band_step": 800.0}
    assert sft_line({"s": old}, "s") == ("s: held-out accuracy 0.2734 (our float32 decoder), "
                                         "entered the band at SFT step 800")
    new = dict(old, fingerprint="0123456789abcdef", step=800, test_accuracy=0.25)
    assert sft_line({"s": new}, "s") == ("s [run 0123456789ab, checkpoint step 800]: held-out "
                                         "accuracy 0.2734 (our float32 decoder), entered the "
                                         "band at SFT step 800; test accuracy 0.2500")
    assert sft_line({}, "s") == "s: no cold start recorded"
