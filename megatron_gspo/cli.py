"""Command line: `megatron-gspo {sft,train,eval,config} [--config FILE.yaml] [key=value ...]`.

Examples:
    megatron-gspo sft   --config experiments/demo/sft.yaml
    megatron-gspo train --config experiments/demo/gspo.yaml train.steps=5 loss.name=grpo
    megatron-gspo eval  --config experiments/demo/gspo.yaml init_checkpoint=runs/demo/gspo
    megatron-gspo config            # every key with its default and meaning
    megatron-gspo export --run-dir runs/demo/gspo --to-hf out/  # Hugging Face folder
    torchrun --nproc-per-node 2 -m megatron_gspo.cli train --config ... model.ep=2

Overrides use dotted keys and YAML values; unknown keys are errors. A bad config (typo, wrong
type, bad value, missing file) exits with status 2 and one line naming the key, before anything is
written. The resolved config is saved in run_dir next to metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-gspo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["sft", "train", "eval", "config", "export"])
    parser.add_argument("--config", default=None, help="YAML experiment file")
    # export: a run's latest checkpoint as a Hugging Face model folder (megatron_gspo.export)
    parser.add_argument("--run-dir", default=None, help="export: the run (or step) dir")
    parser.add_argument("--to-hf", default=None, help="export: output folder")
    parser.add_argument("--hf-path", default=None,
                        help="export: source model folder (default: the run's model.hf_path)")
    parser.add_argument("--max-shard-bytes", type=int, default=5 * 1024**3,
                        help="export: safetensors shard size limit")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)
    from megatron_gspo.config import ConfigError, describe_config, load_config

    if args.command == "config":
        print(describe_config())
        return 0
    if args.command == "export":
        return _export(parser, args)
    try:
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as e:
        parser.error(str(e))  # exit 2 with one line, nothing written
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|cuda_graph_scope).*")
    if args.command == "sft":
        from megatron_gspo.sft import run_sft

        result = run_sft(cfg)
    elif args.command == "train":
        from megatron_gspo.trainer import Trainer

        result = Trainer(cfg).train()
    else:
        from megatron_gspo.runtime import evaluate_runtime, setup_runtime

        result = evaluate_runtime(setup_runtime(cfg, lr=0.0, job="eval"))
    print(json.dumps({k: v for k, v in result.items() if k.startswith(("eval/", "reward/"))}))
    return 0


def _export(parser, args) -> int:
    if not args.run_dir or not args.to_hf:
        parser.error("export needs --run-dir R --to-hf OUT")
    from megatron_gspo.export import export_run

    try:
        summary = export_run(args.run_dir, args.to_hf, hf_path=args.hf_path,
                             max_shard_bytes=args.max_shard_bytes)
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
