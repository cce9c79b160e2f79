"""torch.profiler top-10 of our GSPO iteration at a forced response length (bench set-up).

    python -m bench.profile_iteration                           # 64 x 128-token responses
    python -m bench.profile_iteration --max-new-tokens 32 --iterations 1 --top 15
    python -m bench.profile_iteration --readme experiments/throughput/README.md   # table:profile

Same trainer and overrides as `bench.throughput --force-length --skip-trl` (qwen3-moe-tiny,
8 prompts x G=8, 4 minibatches, flip_every=0, 1 thread). After `--warmup` iterations, two
profiler sessions: (1) `--iterations` rollouts (KV-cache sampling + reward), (2) as many
iterations on a fixed, already sampled batch (pi_old pass + 4 optimizer steps). Prints for each
the operators with the largest self CPU time (markdown, as experiments/throughput/README.md
shows them; with a GPU, also by self GPU time) and the trainer's own phase timings (slower than
unprofiled runs). Then, unprofiled, `--iterations` more on the same batch with wall-clock timers
around the parts of each optimizer step (`step_breakdown`: forward, loss, backward, optimizer,
and inside the optimizer megatron's grads-to-masters, grad norm and Adam; on a GPU each timer
synchronizes, which costs the overlap of host and device). Last, the Python
lines that synchronize host and device during one rollout and one iteration: on a GPU as CUDA
reports them (`sync_sites`), on CPU the calls that would (`would_sync_sites`).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import tempfile
import time
import traceback
import warnings

import torch
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile

from bench.throughput import build_ours, cpu_model, parse_args as bench_args
from tools.result_table import add_readme_args, write_into


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--iterations", type=int, default=2, help="profiled iterations per session")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--top", type=int, default=10, help="rows per table")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override (repeatable)")
    add_readme_args(p, "profile")
    return p.parse_args(argv)


def top_table(prof, n: int, where: str = "CPU") -> str:
    """Markdown: the n operators with the largest self time on the CPU (host) or the GPU."""
    def self_us(e) -> float:
        return e.self_cpu_time_total if where == "CPU" else e.self_device_time_total

    rows = sorted(prof.key_averages(), key=self_us, reverse=True)[:n]
    total = sum(self_us(e) for e in prof.key_averages()) or 1.0
    out = [f"| operator | self {where} ms | % | calls |", "|---|---|---|---|"]
    for e in rows:
        out.append(f"| `{e.key}` | {self_us(e) / 1e3:.1f} | {100 * self_us(e) / total:.1f} | "
                   f"{e.count} |")
    out.append(f"| total | {total / 1e3:.1f} | 100 | "
               f"{sum(e.count for e in prof.key_averages())} |")
    return "\n".join(out)


STEP_PARTS = (("forward", "policy", "token_logprobs"), ("loss", "trainer", "loss_fn"),
              ("backward", "policy", "backward"), ("optimizer", "policy", "step"))
# inside "optimizer": megatron's ChainedOptimizer pieces that `moe.model.optim.PolicyOptimizer.step`
# calls (the clip pass, when it runs, and the schedule are the rest of "optimizer")
OPTIMIZER_PARTS = (("of which: main grads to masters", "megatron", "prepare_grads"),
                   ("of which: grad norm", "megatron", "get_grad_norm"),
                   ("of which: Adam", "megatron", "step_with_ready_grads"))


@contextlib.contextmanager
def shadowed(obj, attr: str, value):
    """Within: `obj.attr` is `value` (an instance attribute); after: what it was before (an
    instance attribute set back, or none: the class's again)."""
    had, old = attr in vars(obj), vars(obj).get(attr)
    setattr(obj, attr, value)
    try:
        yield
    finally:
        if had:
            setattr(obj, attr, old)
        else:
            delattr(obj, attr)


def step_breakdown(trainer, iterations: int) -> str:
    """Markdown: wall ms per optimizer step of each part of `Trainer.train_step`, over
    `iterations` iterations (the parts are timed only inside `train_step`)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    parts = STEP_PARTS + OPTIMIZER_PARTS
    spent = {name: 0.0 for name, _, _ in parts} | {"train_step": 0.0}
    owners = {"policy": trainer.policy, "trainer": trainer,
              "megatron": trainer.policy.optimizer.optimizer}

    def timed(name, fn):
        def call(*a, **k):
            sync()
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                sync()
                spent[name] += time.perf_counter() - t0
        return call

    step = trainer.train_step

    def train_step(*a, **k):
        with contextlib.ExitStack() as stack:
            for name, who, attr in parts:
                obj = owners[who]
                stack.enter_context(shadowed(obj, attr, timed(name, getattr(obj, attr))))
            return timed("train_step", step)(*a, **k)

    steps_before = trainer.state.opt_step
    with shadowed(trainer, "train_step", train_step):
        for _ in range(iterations):
            trainer.iteration()
    n = trainer.state.opt_step - steps_before
    total = spent["train_step"] or 1.0
    rows = ["| part of an optimizer step | ms per step | % of the step |", "|---|---|---|"]
    rest = total - sum(spent[name] for name, _, _ in STEP_PARTS)
    for name, t in [(name, spent[name]) for name, _, _ in parts] + [
            ("rest (metrics, flips, replay set-up)", rest), ("train_step", total)]:
        rows.append(f"| {name} | {1e3 * t / n:.1f} | {100 * t / total:.0f} |")
    return "\n".join(rows)


def sync_sites(run, top: int) -> str:
    """CUDA: markdown of the Python lines that made the host wait for the GPU while `run()` ran
    (`torch.cuda.set_sync_debug_mode("warn")`: a warning per synchronizing call), most first."""
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode(before)
    return sites_table([w for w in caught if "synchroniz" in str(w.message)], top)


# Calls whose result the host must read from the device: on a GPU each one waits for every
# kernel queued before it (item / bool / float / int / tolist / cpu / numpy / equal / allclose
# read values; masked_select / nonzero / unique / bincount size their output by the data).
SYNCING = frozenset({
    torch.Tensor.cpu, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__,
    torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.numpy,
    torch.Tensor.masked_select, torch.masked_select, torch.Tensor.nonzero, torch.nonzero,
    torch.equal, torch.Tensor.equal, torch.allclose, torch.Tensor.allclose, torch.argwhere,
    torch.Tensor.argwhere,
    torch.unique, torch.Tensor.unique, torch.unique_consecutive, torch.Tensor.unique_consecutive,
    torch.bincount, torch.Tensor.bincount})


def syncs(func, args: tuple, kwargs: dict) -> bool:
    """Whether this call would make the host wait for a GPU: a `SYNCING` function, or one that
    does depending on its arguments: one-argument `where` (= nonzero), indexing with a boolean
    mask, `repeat_interleave` by a tensor of repeats (or of the repeats alone) without
    `output_size`. Not seen: `.to` / `copy_` onto the host (on CPU every tensor is there
    already, and megatron's router moves its weights with `.to(device)` each forward on CPU,
    which a GPU run skips) and syncs made inside C++ ops."""
    if func in SYNCING:
        return True
    if func is torch.where:
        return len(args) + len(kwargs) == 1
    if func is torch.Tensor.__getitem__:
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                   for i in index)
    if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave):
        # repeat_interleave(repeats) alone, or by a repeats tensor: the output size is the data's
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0] if args else None)
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    return False


class WouldSync(TorchFunctionMode):
    """Within: records each call made while `active` that would synchronize host and device
    (`syncs`), as the first stack frame outside torch (`records`: FrameSummary with filename,
    lineno). Device-independent: on CPU, the calls that would make the host wait for a GPU, plus
    those on tensors a GPU run keeps on the host anyway (it cannot tell them apart: e.g. the
    sampler's per-row done flags)."""

    def __init__(self):
        super().__init__()
        self.active, self.records = True, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.active and syncs(func, args, kwargs):
            inside_torch = f"{os.sep}torch{os.sep}"
            self.records.append(next(f for f in reversed(traceback.extract_stack()[:-1])
                                     if inside_torch not in f.filename))
        return func(*args, **kwargs)


def would_sync_sites(run, top: int) -> str:
    """Markdown of the Python lines whose calls would synchronize host and device on a GPU
    while `run()` ran (`WouldSync`; any device), most first."""
    with WouldSync() as mode:
        run()
    return sites_table(mode.records, top)


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def site(path: str, lineno: int) -> str:
    """`path:lineno` from the package root: a file of this repository relative to it, an
    installed package's after its site-packages / dist-packages / --target folder."""
    path = os.path.abspath(path)
    for root in ("site-packages", "dist-packages", os.path.join("tmp", "site")):
        marker = os.sep + root + os.sep  # first: a venv may live inside the repository
        if marker in path:
            return f"{path.split(marker, 1)[1]}:{lineno}"
    if path.startswith(REPO + os.sep):
        return f"{os.path.relpath(path, REPO)}:{lineno}"
    return f"{path}:{lineno}"


def sites_table(records, top: int) -> str:
    """Markdown: records (warnings, stack frames) counted per call site (`site`), most first."""
    counts = collections.Counter(site(r.filename, r.lineno) for r in records)
    rows = ["| call site | host-device syncs |", "|---|---|"]
    rows += [f"| `{k}` | {n} |" for k, n in counts.most_common(top)]
    return "\n".join(rows + [f"| total ({len(counts)} sites) | {sum(counts.values())} |"])


def main(argv=None) -> int:
    args = parse_args(argv)
    bargs = bench_args(["--force-length", "--skip-trl", "--max-new-tokens",
                        str(args.max_new_tokens)] + [f"--set={s}" for s in args.set])
    torch.set_num_threads(1)
    gpu = torch.cuda.is_available()
    with tempfile.TemporaryDirectory(prefix="profile_ours_") as tmp:
        trainer, overrides = build_ours(bargs, tmp + "/run")
        for _ in range(args.warmup):
            trainer.iteration()
        it = trainer.state.iteration
        t0 = time.perf_counter()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
        with profile(activities=activities) as rollout_prof:
            batches = [trainer.rollout(it + i) for i in range(args.iterations)]
        rollout_s = (time.perf_counter() - t0) / args.iterations
        sample = trainer.rollout
        trainer.rollout = lambda i: batches[0]
        with profile(activities=activities) as train_prof:
            timings = [trainer.iteration() for _ in range(args.iterations)]
        breakdown = step_breakdown(trainer, args.iterations)
        one_of_each = lambda: (sample(it), trainer.iteration())  # noqa: E731
        syncs = sync_sites(one_of_each, args.top) if gpu else would_sync_sites(one_of_each,
                                                                                args.top)
        trainer.rt.close()
    device = f", {torch.cuda.get_device_name()}" if gpu else ""
    tables = []
    for where in ["CPU"] + (["GPU"] if gpu else []):
        tables += [f"\nrollout ({args.iterations} batches), top {args.top} by self {where} "
                   "time:\n", top_table(rollout_prof, args.top, where),
                   f"\npi_old pass + 4 optimizer steps ({args.iterations} iterations), top "
                   f"{args.top} by self {where} time:\n", top_table(train_prof, args.top, where)]
    text = "\n".join([
        f"machine: {cpu_model()}{device}; torch {torch.__version__}, 1 thread; "
        f"{len(batches[0])} sequences x {args.max_new_tokens} new tokens; overrides: "
        f"{' '.join(overrides[1:])}", *tables,
        f"\nprofiled seconds per iteration: rollout {rollout_s:.3f}; " + "; ".join(
            f"{k} {sum(t[f'time/{k}'] for t in timings) / len(timings):.3f}"
            for k in ("old_forward", "train")),
        f"\nunprofiled, {args.iterations} iterations of {len(batches[0])} sequences in 4 "
        "optimizer steps each, wall time of the parts of a step:\n", breakdown]
        + ["\nhost-device synchronizations over one rollout and one iteration, by call site"
           + ("" if gpu else " (counted on CPU: the calls that synchronize on a GPU)")
           + ":\n", syncs])
    print(text)
    if args.readme:
        write_into(args.readme, text, args.marker)
    return 0


if __name__ == "__main__":
    sys.exit(main())
