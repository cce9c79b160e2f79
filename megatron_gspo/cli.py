"""Command line: `megatron-gspo {sft,train,eval,config,export,plan} [--config F.yaml] [k=v ...]`.

Examples:
    megatron-gspo sft   --config experiments/demo/sft.yaml
    megatron-gspo train --config experiments/demo/gspo.yaml train.steps=5 loss.name=grpo
    megatron-gspo eval  --config experiments/demo/gspo.yaml init_checkpoint=runs/demo/gspo
                        # prints eval/... (validation split) and test/... (test split)
    megatron-gspo train --config my.yaml --plugin my_plugin.py  # user code (docs/extending.md)
    megatron-gspo config            # every key with its default and meaning
    megatron-gspo export --run-dir runs/demo/gspo --to-hf out/  # Hugging Face folder
    megatron-gspo plan --config experiments/ablation/qwen3_30b_a3b.yaml --gpus 16 --gpu-mem-gib 80
    torchrun --nproc-per-node 2 -m megatron_gspo.cli train --config ... model.ep=2

Overrides use dotted keys and YAML values; unknown keys are errors. A bad config (typo, wrong
type, bad value, unregistered name or one a plugin registers twice, malformed YAML, missing file
or checkpoint), a run dir that belongs to another run, a corrupt checkpoint, weights / a loss
gone non-finite, a full disk under metrics.jsonl, out of memory in a training phase (naming the
settings to lower), or an optional package a setting needs (pyarrow, math-verify, wandb,
transformers) exits with status 2 and one line naming it (`megatron_gspo.errors.UserError`, and
the few other types `USER_ERRORS` lists); nothing already written is lost. SIGTERM / Ctrl-C /
SIGHUP saves a checkpoint and exits with 128 + the signal number (during start-up, before the
first step: it exits at once, one line, the same status). The resolved config is saved in
run_dir next to metrics.jsonl on a run's first start.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import warnings

from megatron_gspo.config.schema import describe_config, load_config_origins
from megatron_gspo.errors import ConfigError, UserError
from megatron_gspo.jobs import plan
from megatron_gspo.jobs.plan_packed import mean_response_of
from megatron_gspo.rollout.backends import unused_settings
from megatron_gspo.run.plugins import load_plugins
from megatron_gspo.run.preempt import Interrupted, Preempted, StartupSignals
from megatron_gspo.run.record import recorded_plugins
from moe.platform.checks import DuplicateName, MissingDependency

# What exits 2 with its one line: the project's UserError, and what it cannot subclass: a
# missing file (raised by moe and the stdlib as FileNotFoundError), a missing optional package
# and a name registered twice (moe's own types: moe does not import megatron_gspo), weights or
# a loss gone non-finite.
USER_ERRORS = (UserError, FileNotFoundError, MissingDependency, DuplicateName,
               FloatingPointError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-gspo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["sft", "train", "eval", "config", "export", "plan"])
    parser.add_argument("--config", default=None, help="YAML experiment file")
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE_OR_PATH",
                        help="import user code that registers a loss, reward, task, sampler or "
                             "Hugging Face family (adds to the config's `plugins`; export: "
                             "instead of the run's own; repeatable; docs/extending.md)")
    # export: a run's latest checkpoint as a Hugging Face model folder (megatron_gspo.run.export)
    parser.add_argument("--run-dir", default=None,
                        help="export: the run (or step) dir; plan: a run whose mean response "
                             "length sizes the packed column")
    parser.add_argument("--to-hf", default=None, help="export: output folder")
    parser.add_argument("--hf-path", default=None,
                        help="export: source model folder (default: the run's model.hf_path)")
    parser.add_argument("--max-shard-bytes", type=int, default=5 * 1024**3,
                        help="export: safetensors shard size limit")
    # plan: the config's per-GPU memory and step time on N GPUs (megatron_gspo.jobs.plan)
    parser.add_argument("--gpus", type=int, default=None, help="plan: number of GPUs")
    parser.add_argument("--gpu-mem-gib", type=float, default=None,
                        help="plan: memory of one GPU in GiB")
    parser.add_argument("--mean-response-tokens", type=float, default=None,
                        help="plan: the mean response length, for the packed column beside "
                             "the full-length bound (or --run-dir: its runs' "
                             "response/length/mean)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    return parser


def _fail(message: str) -> int:
    """One line on stderr (rank 0 only under torchrun), exit status 2, no traceback."""
    if os.environ.get("RANK", "0") == "0":
        print(f"megatron-gspo: error: {message}", file=sys.stderr, flush=True)
    return 2


def _stopped(e) -> int:
    """A signal stopped the job (`Preempted` after a save, `Interrupted` during start-up): its
    one line on stderr, exit status 128 + the signal number."""
    if os.environ.get("RANK", "0") == "0":
        print(f"megatron-gspo: {e}", file=sys.stderr, flush=True)
    return 128 + e.signum


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)
    if args.command == "config":
        try:
            load_plugins(args.plugin)  # their parts' settings listed too
        except USER_ERRORS as e:
            return _fail(str(e))
        print(describe_config())
        return 0
    if args.command == "plan":
        return _plan(args)
    if args.command == "export" and not (args.run_dir and args.to_hf):
        parser.error("export needs --run-dir R --to-hf OUT")
    return _lifetime(args)


def _lifetime(args) -> int:
    """The one lifetime of every command that runs (sft, train, eval, export): megatron's
    install warnings hidden; a signal during start-up exits at once with one line; a job
    stopped by a signal after its save, and every user error (exit 2, one line), end here; the
    result is printed once (rank 0). Each command closes what it opens (a job its runtime,
    export its staging folder) before its error or result arrives here."""
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|cuda_graph_scope).*")
    # torch's deprecations inside megatron's dist_checkpointing: nothing a user can act on
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=".*(`load_state_dict` is deprecated|use DTensor instead).*")
    export = args.command == "export"
    # export's ValueError / OSError name a run dir or folder it cannot read or write
    errors = USER_ERRORS + (OSError, ValueError) if export else USER_ERRORS
    try:
        with StartupSignals():  # a signal before the training loop: one line, no traceback
            result = _export(args) if export else _run_job(args)
    except (Interrupted, Preempted) as e:
        return _stopped(e)
    except errors as e:
        return _fail(str(e))  # nothing already written is lost
    if result and os.environ.get("RANK", "0") == "0":  # once under torchrun
        print(json.dumps(result if export else {
            k: v for k, v in result.items() if k.startswith(("eval/", "test/", "reward/"))}))
    return 0


def _run_job(args) -> dict:
    """sft / train / eval: load the config, check its registered names, and `run` it."""
    # heavy import (the registries: torch, megatron-core): `config` and argument errors answer
    # in a fraction of a second without it
    from megatron_gspo.run.names import check_names

    cfg, origins = load_config_origins(args.config, args.overrides,
                                       plugins=lambda head: _plugins(head, args, args.command))
    check_names(cfg)  # before anything is written
    _warn(unused_settings(cfg, origins))
    return run(args.command, cfg)


def _warn(lines: list[str]) -> None:
    """Each line as a warning on stdout (rank 0 only under torchrun)."""
    for line in lines if os.environ.get("RANK", "0") == "0" else ():
        print(f"WARNING: {line}", flush=True)


def _plugins(head, args, job: str | None = None) -> list[str]:
    """The plugins of the run `head` (the config's keys run_dir, resume, plugins) with the
    `--plugin` entries (with `job`: or, none given, those its run dir recorded), imported here,
    before the rest of the config is read (their parts' settings are keys of it)."""
    head = _with_plugins(head, args)
    head = _resumed_plugins(head, job) if job else head
    load_plugins(head.plugins)
    return head.plugins


def _with_plugins(cfg, args):
    """`cfg` with the `--plugin` entries added to its `plugins` (recorded with the run's config,
    so that a resume imports them too)."""
    return dataclasses.replace(cfg, plugins=[*cfg.plugins, *args.plugin]) if args.plugin else cfg


def _resumed_plugins(cfg, job: str):
    """`cfg`, or with no plugins given, with those `cfg.run_dir`'s run of `job` recorded (a
    resume without `--plugin`), said on rank 0; a recorded one that cannot be imported here is
    one line naming the record."""
    recorded = [] if cfg.plugins or cfg.resume is False else recorded_plugins(cfg.run_dir, job)
    if not recorded:
        return cfg
    try:
        load_plugins(recorded)
    except ConfigError as e:
        raise ConfigError(f"{e}; run_dir={cfg.run_dir} recorded it in {job}_config.yaml: pass "
                          "--plugin with its place here") from None
    if os.environ.get("RANK", "0") == "0":
        print(f"resuming run_dir={cfg.run_dir}: importing the plugins it recorded: {recorded}",
              flush=True)
    return dataclasses.replace(cfg, plugins=recorded)


def run(command: str, cfg) -> dict:
    """The job of `command` on `cfg` (`megatron_gspo.jobs`: each module's `run`)."""
    # heavy imports (torch, megatron-core: seconds), which only a job needs
    from megatron_gspo.jobs import evaluate, rl, sft

    return {"sft": sft, "train": rl, "eval": evaluate}[command].run(cfg)


def _plan(args) -> int:
    """The plan's text; exit 0 when the config's layout fits, 1 when it does not, 2 (one line)
    for bad input or a layout that cannot exist."""
    if args.gpus is None or args.gpus < 1 or args.gpu_mem_gib is None \
            or not args.gpu_mem_gib > 0:
        return _fail(f"plan needs --gpus N >= 1 and --gpu-mem-gib M > 0 (got --gpus "
                     f"{args.gpus}, --gpu-mem-gib {args.gpu_mem_gib})")
    mean = args.mean_response_tokens
    if mean is not None and not mean > 0:
        return _fail(f"--mean-response-tokens={mean:g} must be > 0")
    try:
        cfg, origins = load_config_origins(  # a backend, task or family of its plugins
            args.config, args.overrides, plugins=lambda head: _plugins(head, args))
        _warn(unused_settings(cfg, origins))
        if mean is None and args.run_dir:
            mean = mean_response_of(args.run_dir)
        text, fits = plan.report(args.config or "the default config", cfg, args.gpus,
                                 args.gpu_mem_gib, mean)
    except USER_ERRORS as e:
        return _fail(str(e))
    print(text)
    return 0 if fits else 1


def _export(args) -> dict:
    """`export`: the run's latest checkpoint as a Hugging Face folder; its summary."""
    from megatron_gspo.run import export  # heavy import (torch, megatron-core): export only

    return export.export_run(args.run_dir, args.to_hf, hf_path=args.hf_path,
                             max_shard_bytes=args.max_shard_bytes, plugins=args.plugin)


if __name__ == "__main__":
    sys.exit(main())
