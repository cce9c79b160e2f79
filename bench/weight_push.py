"""Weight push to a vLLM engine: seconds per GB, in-process vs engine servers, side by side.

    python -m bench.weight_push                        # ~100 MB pushed, 5 rounds, TP=2 server
    python -m bench.weight_push --layers 2 --rounds 10 --tp 1 2
    python -m bench.weight_push --readme docs/vllm.md --marker weight_push

The model is `--preset` (default `small`, Qwen3-MoE-shaped) cut to `--layers` decoder layers:
`small` has 512 hidden, 64 experts of FFN 256 per layer, about 100 MB of float32 per layer, and
its head_dim 64 runs on vLLM's CPU attention; the embedding and output layer are pushed for the
tokenizer's rows only. It is built here from the preset (random weights), trained on 2-digit
addition. One trainer per side, built in this process: `rollout.backend=vllm` in process
(`VLLMEngine.push_weights`: `reload_weights` and the CPU repacks) and, per `--tp`, in server
mode (`RemoteEngine.push`: buckets broadcast over a gloo group to the engine's workers, each
loading them with vLLM's layerwise reload and repacking). Each round times, per side, one push
of the policy's weights after `MoEPolicy.weights_changed()` (the version moves, the weights
stay: every push moves the same bytes), from the first gathered tensor to the engine's last
answer; and, once per round, the stream alone (`hf_stream`: gathering and naming the
tensors, what every push pays on the trainer). Sides alternate within a round, so a noisy
machine's drift hits each; the report gives the median over rounds, the fastest, and each
server's ratio to the in-process push. No probe here (`rollout/push_probe_diff` after a push is
the trainer's, not the engine's, cost).

Between two timed pushes the bench waits `--settle-s`: vLLM's multiprocessing workers (a server
at TP > 1) poll their message queue without sleeping for a second after each message, and on a
machine with fewer cores than processes that polling would be billed to the next side's push.
The in-process engine binds this process's threads (vLLM's CPU worker) and is built last.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from megatron_gspo.config.schema import load_config
from megatron_gspo.jobs.rl import Trainer
from megatron_gspo.rollout.vllm.sampler import hf_stream
from tools.result_table import add_readme_args, cpu_name, output_into

IN_PROCESS = "in-process"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small", help="model preset (head_dim 32 or 64 on CPU)")
    p.add_argument("--layers", type=int, default=1, help="decoder layers of the preset")
    p.add_argument("--rounds", type=int, default=5, help="measured pushes per side")
    p.add_argument("--tp", type=int, nargs="+", default=[2],
                   help="tensor_parallel_size of each server side (one side per value)")
    p.add_argument("--bucket-mb", type=float, default=256.0)
    p.add_argument("--settle-s", type=float, default=1.5,
                   help="seconds between two timed pushes (see the module docstring)")
    add_readme_args(p, "weight_push")
    args = p.parse_args(argv)
    if args.layers < 1 or args.rounds < 1 or min(args.tp) < 1 or args.settle_s < 0:
        p.error("--layers, --rounds and --tp must be >= 1, --settle-s >= 0")
    return args


def build(run_dir: str, args, *extra) -> Trainer:
    return Trainer.from_config(load_config(None, [
        f"run_dir={run_dir}", f"model.preset={args.preset}", f"model.num_layers={args.layers}",
        "model.max_seq_len=64", "task.name=addition", "task.kwargs.num_digits=2",
        "rollout.backend=vllm", "train.eval_every=0", "train.save_every=0",
        "wandb.mode=disabled", f"rollout.vllm.bucket_mb={args.bucket_mb}", *extra]))


def push_once(trainer: Trainer) -> float:
    """Seconds of one push of the policy's weights (stream, transfer, load, repack)."""
    sampler, policy = trainer.rt.sampler, trainer.policy
    policy.weights_changed()
    t0 = time.perf_counter()
    stream = hf_stream(policy, sampler.hf_config)
    if sampler.server:
        sampler.engine.push(stream, policy.version)
    else:
        sampler.engine.push_weights(stream)
    return time.perf_counter() - t0


def stream_once(trainer: Trainer) -> tuple[float, int]:
    """(seconds, bytes) of iterating the push's stream alone."""
    t0, size = time.perf_counter(), 0
    for _, tensor in hf_stream(trainer.policy, trainer.rt.sampler.hf_config):
        size += tensor.numel() * tensor.element_size()
    return time.perf_counter() - t0, size


def server_side(tp: int) -> str:
    return f"server, TP={tp}"


def measure(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench_weight_push_") as tmp:
        sides = {server_side(tp): build(os.path.join(tmp, f"tp{tp}"), args,
                                        "rollout.vllm.mode=server",
                                        f"rollout.vllm.tensor_parallel_size={tp}")
                 for tp in args.tp}
        sides[IN_PROCESS] = build(os.path.join(tmp, "inproc"), args)  # last: binds threads
        times = {name: [] for name in ["stream alone", *sides]}
        size = 0
        try:
            for trainer in sides.values():  # the first push of each (engine warm-up)
                push_once(trainer)
            for _ in range(args.rounds):
                seconds, size = stream_once(sides[IN_PROCESS])
                times["stream alone"].append(seconds)
                for name, trainer in sides.items():
                    time.sleep(args.settle_s)
                    times[name].append(push_once(trainer))
        finally:
            for trainer in reversed(list(sides.values())):
                trainer.rt.close()
    return {"times": times, "bytes": size}


def report(args, res: dict) -> None:
    gb = res["bytes"] / 1e9
    print(f"pushed per round: {res['bytes'] / 2**20:.1f} MiB ({gb:.3f} GB) of float32 tensors, "
          f"{args.preset} preset cut to {args.layers} layer(s); {args.rounds} rounds, sides "
          f"alternating, {args.settle_s:g} s apart")
    print("\n| side | s per push (median) | s per GB (median) | s per GB (fastest) |")
    print("|---|---|---|---|")
    medians = {}
    for name, values in res["times"].items():
        medians[name] = statistics.median(values)
        print(f"| {name} | {medians[name]:.3f} | {medians[name] / gb:.2f} | "
              f"{min(values) / gb:.2f} |")
    print()
    for tp in args.tp:
        print(f"{server_side(tp)} / {IN_PROCESS} (median): "
              f"{medians[server_side(tp)] / medians[IN_PROCESS]:.2f}x")
    print(f"\nmachine: {cpu_name('unknown CPU')}, {os.cpu_count()} cores; bucket "
          f"{args.bucket_mb:g} MiB; the stream alone is part of every push")


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    res = measure(args)
    with output_into(args.readme, args.marker):
        report(args, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
