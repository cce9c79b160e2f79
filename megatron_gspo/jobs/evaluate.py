"""`megatron-gspo eval`: a policy's greedy accuracy on the validation split (`eval/...`, what a
run's evals read) and its scores on the test split (`test/...`), one progress line per batch of
prompts on stderr. It reads `init_checkpoint` (or `model.hf_path`'s weights), never run_dir's
checkpoints, and writes nothing: no run-dir claim, no record, no metrics log. Its runtime (the
sampler's memory, an engine's process) is closed however the eval ends.
"""

from __future__ import annotations

import os
import sys

from megatron_gspo.config.schema import RunConfig
from megatron_gspo.run.setup import JobSpec, evaluate_runtime, evaluate_test, setup_runtime

SPEC = JobSpec("eval", writes=False)
"""No optimizer, nothing written, nothing resumed."""


def untrained_warning(cfg: RunConfig) -> str:
    """The warning for an eval that would score a fresh random init ("" when it reads weights):
    run_dir's checkpoints are not read, so without init_checkpoint or model.hf_path there are
    none."""
    if cfg.init_checkpoint or cfg.model.hf_path:
        return ""
    return ("megatron-gspo: warning: eval without init_checkpoint or model.hf_path scores "
            f"untrained weights; init_checkpoint={cfg.run_dir} evaluates that run")


def run(cfg: RunConfig) -> dict:
    """`eval/...` on the validation split and `test/...` on the test split (step 0's stream)."""
    warning = untrained_warning(cfg)
    if warning and os.environ.get("RANK", "0") == "0":
        print(warning, file=sys.stderr, flush=True)
    rt = setup_runtime(cfg, SPEC)
    try:
        return {**evaluate_runtime(rt, progress="eval"),
                **evaluate_test(rt, step=0, progress=True)}
    finally:
        rt.close()
