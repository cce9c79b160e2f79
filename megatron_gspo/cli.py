"""Command line: `megatron-gspo {sft,train,eval,config} [--config FILE.yaml] [key=value ...]`.

Examples:
    megatron-gspo sft   --config experiments/demo/sft.yaml
    megatron-gspo train --config experiments/demo/gspo.yaml train.steps=5 loss.name=grpo
    megatron-gspo eval  --config experiments/demo/gspo.yaml init_checkpoint=runs/demo/gspo
    megatron-gspo config            # every key with its default and meaning
    torchrun --nproc-per-node 2 -m megatron_gspo.cli train --config ... model.ep=2

Overrides use dotted keys and YAML values; unknown keys are errors. A bad config (typo, wrong
type, bad value, malformed YAML, missing file or checkpoint), a run dir that belongs to another
run, or a corrupt checkpoint exits with status 2 and one line naming it; nothing already written
is lost. SIGTERM / Ctrl-C saves a checkpoint and exits with 128 + the signal number. The resolved
config is saved in run_dir next to metrics.jsonl on a run's first start.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-gspo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["sft", "train", "eval", "config"])
    parser.add_argument("--config", default=None, help="YAML experiment file")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    return parser


def _fail(message: str) -> int:
    """One line on stderr (rank 0 only under torchrun), exit status 2, no traceback."""
    if os.environ.get("RANK", "0") == "0":
        print(f"megatron-gspo: error: {message}", file=sys.stderr, flush=True)
    return 2


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)
    from megatron_gspo.checkpoint import CheckpointError
    from megatron_gspo.config import ConfigError, describe_config, load_config
    from megatron_gspo.preempt import Preempted
    from megatron_gspo.rundir import RunDirError

    if args.command == "config":
        print(describe_config())
        return 0
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|cuda_graph_scope).*")
    try:
        cfg = load_config(args.config, args.overrides)
        result = run(args.command, cfg)
    except (ConfigError, FileNotFoundError, RunDirError, CheckpointError) as e:
        return _fail(str(e))  # nothing already written is lost
    except Preempted as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"megatron-gspo: {e}", file=sys.stderr, flush=True)
        return 128 + e.signum
    if result:
        print(json.dumps({k: v for k, v in result.items() if k.startswith(("eval/", "reward/"))}))
    return 0


def run(command: str, cfg) -> dict:
    if command == "sft":
        from megatron_gspo.sft import run_sft

        return run_sft(cfg)
    if command == "train":
        from megatron_gspo.trainer import Trainer

        return Trainer(cfg).train()
    from megatron_gspo.runtime import evaluate_runtime, setup_runtime

    return evaluate_runtime(setup_runtime(cfg, lr=0.0, job="eval"))


if __name__ == "__main__":
    sys.exit(main())
