"""One sampling step at a real vocabulary: drawn where the logits are vs on the host, side by side.

    python -m bench.sampling                        # B=64, V=151,936 (Qwen3), 30 steps
    python -m bench.sampling --batch 16 --vocab 4096 --top-p 0.9
    python -m bench.sampling --readme FILE.md      # + between FILE.md's table:sampling markers

Times one decode step's sampling (`megatron_gspo.rollout.decoders.draw`: temperature, log-softmax,
top-p, the draw, the drawn ids' log-probs) on random float32 logits [B, V] that live on the
device (CUDA when there is one, else CPU), in the two placements the sampler has had:

- `device`: drawn where the logits are, the B ids and log-probs copied to the host (what
  the decoder samplers do, `megatron_gspo.rollout.decoders`);
- `host`: the [B, V] logits copied to the host first, drawn there (the sampler before).

Alternating step by step after a warm-up; best and median milliseconds per step, and the
host / device ratio of the medians. On CPU both placements are the same work (ratio ~1: a
control); on a GPU the ratio is what the change saves per generated token.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from megatron_gspo.rollout.decoders import device_generator, draw
from megatron_gspo.rollout.sampler import SamplingParams
from bench.throughput import cpu_model
from tools.result_table import add_readme_args, output_into

QWEN3_VOCAB = 151_936


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64, help="sequences sampled per step (B)")
    p.add_argument("--vocab", type=int, default=QWEN3_VOCAB, help="logits per row (V)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus filter (1 = off)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per placement")
    p.add_argument("--warmup", type=int, default=3)
    add_readme_args(p, "sampling")
    args = p.parse_args(argv)
    for name in ("batch", "vocab", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name}={getattr(args, name)}: must be >= 1")
    return args


def timed_step(logits_BV: torch.Tensor, where: str, generators: dict, top_p: float) -> float:
    """Seconds for one sampling step in placement `where` ('device' or 'host'), ending with the
    ids and log-probs on the host (on a GPU the copy waits for the kernels)."""
    if logits_BV.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    source = logits_BV if where == "device" else logits_BV.cpu()
    ids_B, logp_B = draw(source, SamplingParams(max_new_tokens=1, top_p=top_p),
                         generator=generators[where])
    ids_B, logp_B = ids_B.cpu(), logp_B.cpu()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    host_gen = torch.Generator().manual_seed(0)
    generators = {"host": host_gen, "device": device_generator(host_gen, device)}
    logits_BV = torch.randn(args.batch, args.vocab, generator=torch.Generator().manual_seed(1))
    logits_BV = logits_BV.mul_(3.0).to(device)
    seconds: dict[str, list[float]] = {"device": [], "host": []}
    for i in range(args.warmup + args.steps):
        for where in seconds:
            s = timed_step(logits_BV, where, generators, args.top_p)
            if i >= args.warmup:
                seconds[where].append(s)
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    median = {k: statistics.median(v) for k, v in seconds.items()}
    with output_into(args.readme, args.marker):
        print(f"machine: {machine}; torch {torch.__version__}, {torch.get_num_threads()} "
              f"threads; logits [{args.batch}, {args.vocab}] float32 on {device.type}, top_p "
              f"{args.top_p}; {args.steps} steps per placement, alternating, after "
              f"{args.warmup} warm-up\n")
        print("| sampled | best ms per step | median ms per step |\n|---|---|---|")
        for where, values in seconds.items():
            print(f"| {where} | {min(values) * 1e3:.3f} | {median[where] * 1e3:.3f} |")
        print(f"\nmedian step, host / device: {median['host'] / median['device']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
