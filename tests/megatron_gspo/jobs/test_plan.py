"""`megatron-gspo plan` (megatron_gspo.jobs.plan): the per-GPU table and its exit statuses, the
one-line refusals of layouts that cannot exist, the layout pick, and no torch. Against measured
peaks: test_plan_measured.py; the real-scale profile: tests/experiments/test_qwen3_30b_a3b.py."""

import json
import os
import subprocess
import sys

import pytest

from megatron_gspo import cli
from megatron_gspo.config.schema import load_config
from megatron_gspo.jobs import plan
from moe.model.presets import get_preset

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "..")
PROFILE = "experiments/ablation/qwen3_30b_a3b.yaml"
ACCEPTANCE = ["plan", "--config", PROFILE, "--gpus", "16", "--gpu-mem-gib", "80"]
PARTS = ("weights (bf16)", "grads (fp32 main grads)", "fp32 masters (distributed; else",
         "Adam moments (distributed; else", "routing caches: pi_old's",
         "rollout: KV cache (lean: 16 rows x 10240)", "pi_old: no-grad forward (1 row x 10240)",
         "train: saved layers (1 row x 10240 per microbatch, recompute full)",
         "train: log-prob backward")


def test_the_profile_on_16_h100s_prints_the_per_gpu_table_and_fits(capsys):
    """The acceptance command: every part of the per-GPU table in GiB, the peak, that it fits,
    the layouts with the pick, the step time split and the assumptions; exit 0."""
    assert cli.main(ACCEPTANCE) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for part in PARTS:
        row = next(ln for ln in lines if ln.strip().startswith(part))
        assert float(row.split()[-1]) > 0, row
    peak = next(ln for ln in lines if ln.strip().startswith("peak:"))
    assert 40 < float(peak.split()[-1]) < 72, peak
    assert any(ln.startswith("  fits: at most 90% of 80 GiB") for ln in lines)
    table = {tuple(ln.split()[-4:-2]): ln for ln in lines if ln.endswith(("yes", "no"))}
    assert table[("1", "16")].split()[-1] == "yes"  # the config's layout
    assert table[("1", "8")].startswith("*")  # GSPO alone fits EP 8 (the profile: R3's pick)
    for phase in ("rollout", "pi_old", "train", "total"):
        assert any(ln.split()[:1] == [phase] and ln.rstrip().split()[-1] in ("s", "h)")
                   for ln in lines), phase
    assert "model.hf_path=/path/to/Qwen3-30B-A3B does not exist here" in out
    assert "experiments/gpu/results/train_l4.json" in out


def test_a_plan_that_does_not_fit_exits_1(capsys):
    """The same profile on 16 GPUs of 40 GiB: printed, 'does not fit', exit status 1."""
    assert cli.main([*ACCEPTANCE[:-1], "40"]) == 1
    assert "  does not fit: at most 90% of 40 GiB" in capsys.readouterr().out


@pytest.mark.parametrize("argv, line", [
    (["model.ep=3", "--gpus", "3"], "model.tp=1 model.ep=3: preset 'qwen3-30b-a3b': "
     "num_experts=128 is not divisible by ep=3"),
    (["model.tp=8", "model.sequence_parallel=true", "model.ep=8", "--gpus", "16"],
     "model.tp=8 model.ep=8: preset 'qwen3-30b-a3b': num_query_groups=4 is not divisible "
     "by tp=8"),
    (["--gpus", "12"], "--gpus 12 is not a multiple of model.ep=16"),
    (["model.tp=2", "model.sequence_parallel=true", "model.ep=4", "--gpus", "6"],
     "--gpus 6 is not a multiple of model.ep=4"),
    (["--gpus", "32", "rollout.prompts_per_batch=48"],
     "rollout.prompts_per_batch=48 is not divisible by the data-parallel size 32"),
    (["--gpus", "0"], "plan needs --gpus N >= 1 and --gpu-mem-gib M > 0 (got --gpus 0, "
     "--gpu-mem-gib 80.0)"),
    (["--gpus", "16", "model.ep=0"], "model.ep=0"),
], ids=["ep-experts", "tp-heads", "gpus-ep", "gpus-lcm", "dp-batch", "flags", "bad-value"])
def test_a_layout_that_cannot_exist_is_one_line_and_exit_2(capsys, argv, line):
    """EP not dividing the experts, TP not dividing the heads' KV groups, N not a multiple of
    TP and EP, a batch DP does not split, bad flags: one line naming the value, exit 2."""
    code = cli.main(["plan", "--config", PROFILE, "--gpu-mem-gib", "80", *argv])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith(f"megatron-gspo: error: {line}"), err


def test_the_pick_is_the_fitting_layout_with_the_fewest_tp_then_ep_ranks():
    assert plan.pick([(1, 1, 9.0, False), (1, 4, 5.0, True), (1, 8, 4.0, True),
                      (2, 2, 3.0, True)]) == (1, 4)
    assert plan.pick([(1, 1, 9.0, False)]) is None


def test_phases_do_not_add_up_and_the_vllm_engine_stays_for_the_step():
    """The peak is the state and caches plus the largest phase; an in-process vLLM engine's
    weights (the whole model) and cache are there in every phase."""
    p = get_preset("qwen3-30b-a3b")
    cfg = load_config(os.path.join(ROOT, PROFILE))
    lean = plan.plan_layout(p, cfg, 16)
    assert lean.peak == lean.persistent + max(lean.phases.values())
    assert lean.peak < lean.persistent + sum(lean.phases.values())
    vllm = plan.plan_layout(p, load_config(os.path.join(ROOT, PROFILE),
                                           ["rollout.backend=vllm"]), 16)
    engine = dict(vllm.rows)["vLLM engine weights (the whole model)"]
    assert engine == p.num_params()["total"] * 2
    assert vllm.persistent == lean.persistent + engine + 1.0 * plan.GIB
    assert vllm.phases["rollout"] == 0.0


def test_a_vllm_engine_server_leaves_only_the_weight_push_on_the_trainers_gpus():
    """rollout.vllm.mode=server: the engine's weights and cache live on the engine's devices;
    the trainer's rollout phase holds a push's gathered parameter and one bucket."""
    p = get_preset("qwen3-30b-a3b")
    cfg = load_config(os.path.join(ROOT, PROFILE), ["rollout.backend=vllm",
                                                    "rollout.vllm.mode=server"])
    lean = plan.plan_layout(p, load_config(os.path.join(ROOT, PROFILE)), 16)
    server = plan.plan_layout(p, cfg, 16)
    assert not any("engine weights" in label for label, _ in server.rows)
    assert server.persistent == lean.persistent
    fc1 = 128 * 2 * 768 * 2048 * 2  # all 128 experts' fc1 [E, 2F, H] in bf16: 0.75 GiB
    assert server.phases["rollout"] == 2 * fc1 + 256 * 2**20


def test_a_decoder_sampling_beside_the_trainer_holds_a_weight_copy_for_the_whole_step():
    """rollout.max_staleness=1 with the lean decoder: its weight copy (the size of the rank's
    weights) and its KV cache stay through the train phase (it samples while the trainer
    trains), so they are counted with the state, not as a phase."""
    p = get_preset("qwen3-30b-a3b")
    lean = plan.plan_layout(p, load_config(os.path.join(ROOT, PROFILE)), 16)
    stale = plan.plan_layout(p, load_config(os.path.join(ROOT, PROFILE),
                                            ["rollout.max_staleness=1"]), 16)
    rows = dict(stale.rows)
    assert rows["the sampler's weight copy (rollout.max_staleness)"] == rows["weights (bf16)"]
    assert stale.phases["rollout"] == 0.0
    assert stale.persistent == lean.persistent + lean.phases["rollout"] + rows[
        "the sampler's weight copy (rollout.max_staleness)"]


def test_an_hf_path_folder_sizes_the_model_from_its_config_json(tmp_path):
    """With model.hf_path an existing folder, its config.json is the architecture (here a
    Qwen3-MoE config cut to 2 layers), not model.preset; no note about the placeholder."""
    from moe.hf.config import hf_config_dict

    small = get_preset("qwen3-30b-a3b").__class__(
        **{**get_preset("qwen3-30b-a3b").__dict__, "num_layers": 2})
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(small, small.vocab_size)))
    cfg = load_config(os.path.join(ROOT, PROFILE), [f"model.hf_path={tmp_path}"])
    preset, note = plan.model_preset(cfg)
    assert (preset.num_layers, note) == (2, "")
    text, fits = plan.report("x", cfg, 16, 80)
    assert fits and "does not exist" not in text


def test_plan_loads_neither_torch_nor_megatron():
    """A plan answers in a fraction of a second: no torch, no megatron-core, no model."""
    code = (f"import sys; from megatron_gspo import cli; cli.main({ACCEPTANCE!r}); "
            "print(sorted(m for m in ('torch', 'megatron.core') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_the_docs_example_is_the_plans_output(capsys):
    """docs/plan.md shows the acceptance command's output between its plan markers: the same
    text the code prints now (regenerate the block when the accounting changes)."""
    assert cli.main(ACCEPTANCE) == 0
    with open(os.path.join(ROOT, "docs", "plan.md")) as f:
        doc = f.read()
    block = doc.split("<!-- plan:begin -->\n```\n")[1].split("\n```\n<!-- plan:end -->")[0]
    assert block == capsys.readouterr().out.rstrip("\n")


def test_the_vllm_server_docs_example_is_the_plans_output(capsys):
    """docs/vllm.md's Qwen3-30B-A3B deployment (8 trainer GPUs, the engines on 8 others): the
    plan fits the trainer's GPUs, and the page shows its table as the code prints it now."""
    config = "experiments/ablation/qwen3_30b_a3b_vllm_server.yaml"
    assert cli.main(["plan", "--config", config, "--gpus", "8", "--gpu-mem-gib", "80"]) == 0
    out = capsys.readouterr().out
    with open(os.path.join(ROOT, "docs", "vllm.md")) as f:
        doc = f.read()
    block = doc.split("<!-- plan-vllm-server:begin -->\n```\n")[1].split(
        "\n```\n<!-- plan-vllm-server:end -->")[0]
    assert "rollout: push: one bucket" in block and "fits: at most 90% of 80 GiB" in block
    assert out.startswith(block + "\n")


def _column(out: str, label: str) -> tuple[float, float]:
    row = next(ln for ln in out.splitlines() if ln.strip().startswith(label))
    full, packed = row.split()[-2:]
    return float(full), float(packed)


def test_the_packed_column_sizes_real_tokens_beside_the_full_length_bound(capsys, tmp_path):
    """--mean-response-tokens (or a run dir's response/length/mean): a packed column beside
    every row; the no-grad forward and the log-prob backward shrink with a short mean, the
    saved layers of a budget-full microbatch do not, the step's compute shrinks, and the exit
    status still reads the full-length bound. A mean of the whole response is the full
    length."""
    from tests.jsonl import write_metrics

    assert cli.main([*ACCEPTANCE, "--mean-response-tokens", "2048"]) == 0
    out = capsys.readouterr().out
    assert "packed (train.pack): rows of 4,096 real tokens on average" in out
    pi_old, backward = _column(out, "pi_old:"), _column(out, "train: log-prob backward")
    assert pi_old[1] < pi_old[0] / 2 and backward[1] < backward[0] / 2
    layers = _column(out, "train: saved layers")
    assert layers[0] == layers[1]  # the budget (10240 tokens) holds one full row or 2.5 mean
    peak = _column(out, "peak:")
    assert peak[1] < peak[0]
    train = next(ln for ln in out.splitlines() if ln.split()[:1] == ["train"])
    full_s, packed_s = (float(x.replace(",", "")) for x in train.split()[1:5:3])
    assert 3.5 < full_s / packed_s < 4.5  # a quarter of the tokens, and shorter attention
    write_metrics(tmp_path, [{"step": 1, "response/length/mean": 1000.0},
                             {"step": 2, "response/length/mean": 3096.0}, {"step": 0}])
    assert cli.main([*ACCEPTANCE, "--run-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out == out
    assert cli.main([*ACCEPTANCE, "--mean-response-tokens", "8192"]) == 0
    out = capsys.readouterr().out
    for label in ("pi_old:", "train: saved layers", "train: log-prob backward", "peak:"):
        full, packed = _column(out, label)
        assert full == packed, label


def test_the_packed_column_needs_packing_and_a_positive_mean(capsys, tmp_path):
    assert cli.main([*ACCEPTANCE, "--mean-response-tokens", "100", "train.pack=false"]) == 0
    out = capsys.readouterr().out
    assert "packed: none (train.pack=false" in out and "packed GiB" not in out
    assert cli.main([*ACCEPTANCE, "--mean-response-tokens", "-1"]) == 2
    assert "--mean-response-tokens=-1 must be > 0" in capsys.readouterr().err
    assert cli.main([*ACCEPTANCE, "--run-dir", str(tmp_path)]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    assert cli.main([*ACCEPTANCE, "--run-dir", str(tmp_path)]) == 2
    assert "has no response/length/mean" in capsys.readouterr().err
