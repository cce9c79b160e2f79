"""The golden run (torchtitan style): a short SFT then 2 RL iterations of GSPO and of GRPO + R2,
whose per-step metrics are pinned in tests/golden/golden_run.json. A refactor that changes what
the trainer computes changes these numbers; `test_golden.py` compares within `TOLERANCE`.

Twice: with sequence packing (the default, `sft.pack`, `train.pack`) and its padded twin
(`PADDED`, every arm's name + "_padded"), the step as it ran before packing: its numbers were
pinned before packing existed and have not moved.

Each run's rows are pinned by step, keys in KEYS only: a row of none of them (step 0's evals of
the initial policy, in SFT and, with a test split, in RL) pins its step.

Regenerate (only when a change is *meant* to alter the numbers; say why in the commit):
    python -m tests.megatron_gspo.golden --write

Tolerance: relative 1e-4 (absolute 1e-6). The run must not amplify rounding: the first golden
run (40 SFT steps at lr 3e-3) did, by e every ~2 steps, so a run pinned on an AMD EPYC missed
by 5% on an Intel Xeon (grad norm and flips of the first RL step). This one (20 SFT steps at lr
5e-4) stays within 5e-6 of itself when torch, MKL and oneDNN are forced onto other instruction
sets (`PERTURBED_ENV`: different kernels, different rounding), which `test_golden.py` checks on
every run; a real change to a loss, an optimizer or the routing moves these numbers by 1e-3 or
more.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "golden", "golden_run.json")
TOLERANCE = {"rel": 1e-4, "abs": 1e-6}
COMMON = ["model.preset=qwen3-moe-tiny", "task.name=addition", "task.kwargs.num_digits=1",
          "task.n_train=80", "task.n_eval=16", "rollout.prompts_per_batch=4",
          "rollout.group_size=4", "rollout.max_new_tokens=3", "wandb.mode=disabled", "seed=3"]
SFT = ["sft.steps=20", "sft.batch_size=32", "sft.lr=5e-4", "sft.eval_every=0"]
ARMS = {"gspo": ["loss.name=gspo"],
        "grpo_r2": ["loss.name=grpo", "train.routing_replay=r2"]}
RL = ["train.steps=2", "train.num_minibatches=2", "train.eval_every=0", "train.save_every=0",
      "optim.lr=1e-3", "train.flip_every=1"]
PADDED = ["sft.pack=false", "train.pack=false"]
"""The padded twin's overrides: no packing in SFT or RL."""
# Other kernels for the same math: torch's unvectorised CPU kernels, MKL and oneDNN on AVX2
# (ignored where they do not apply, e.g. on ARM).
PERTURBED_ENV = {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                 "ONEDNN_MAX_CPU_ISA": "AVX2"}
KEYS = ("policy/loss", "train/grad_norm", "policy/clip_frac/token", "policy/clip_frac/seq",
        "policy/ratio/mean", "moe/flip_rate_all/mean", "moe/flip_rate_all/layer_00",
        "moe/flip_rate_all/layer_03", "moe/drift_vs_old_all/mean", "reward/mean", "sft/loss")


def run(root: str) -> dict[str, list[dict]]:
    """{arm: [{step, key: value} per logged row]} for the SFT run and each RL arm, packed and
    padded (arm + "_padded")."""
    out = {}
    for twin, extra in (("", []), ("_padded", PADDED)):
        sft_dir = sft(os.path.join(root, "sft" + twin), *extra)
        out["sft" + twin] = rows_of(sft_dir)
        for arm, overrides in ARMS.items():
            d = os.path.join(root, arm + twin)
            rl(d, sft_dir, *overrides, *extra)
            out[arm + twin] = rows_of(d)
    return out


def sft(run_dir: str, *overrides: str) -> str:
    """The golden SFT into `run_dir` (returned)."""
    from megatron_gspo.config.schema import load_config
    from megatron_gspo.jobs.sft import run_sft

    run_sft(load_config(None, [*COMMON, *SFT, *overrides, f"run_dir={run_dir}"]))
    return run_dir


def rl(run_dir: str, sft_dir: str, *overrides: str) -> None:
    """A golden RL run into `run_dir` from `sft_dir`'s checkpoint (`overrides`: its arm's)."""
    from megatron_gspo.config.schema import load_config
    from megatron_gspo.jobs.rl import Trainer

    Trainer.from_config(load_config(None, [*COMMON, *RL, *overrides, f"run_dir={run_dir}",
                                           f"init_checkpoint={sft_dir}"])).train()


def rows_of(run_dir: str) -> list[dict]:
    """A run's pinned rows: {step, key: value} of KEYS, per logged row."""
    from megatron_gspo.run.metrics import read_jsonl

    return _rows(read_jsonl(os.path.join(run_dir, "metrics.jsonl")))


def cpu_model() -> str:
    """The CPU the numbers were measured on (floats differ across CPU makes)."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _rows(records: list[dict]) -> list[dict]:
    return [{"step": r["step"], **{k: r[k] for k in KEYS if k in r}} for r in records]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help=f"overwrite {GOLDEN}")
    ap.add_argument("--out", default=None, metavar="PATH",
                    help="write the result here instead of printing it")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        result = {"cpu": cpu_model(), "runs": run(root)}
    text = json.dumps(result, indent=1, sort_keys=True)
    path = GOLDEN if args.write else args.out
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
        print(f"wrote {os.path.normpath(path)}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
