"""Training-state memory: fp32 vs bf16 with fp32 masters vs megatron's distributed optimizer.

Usage:
    python -m tools.train_memory                    # qwen3-30b-a3b table + measured tiny-deep step
    python -m tools.train_memory --batch 8 --seq 32 # a smaller measured step
    python -m tools.train_memory --no-measure       # just the table
    python -m tools.train_memory --with-recompute   # + bf16 with activation recompute

Analytic part (`moe.model.memory`, which `megatron-gspo plan` uses too): bytes per parameter of the
model state megatron keeps for training (its distributed-optimizer docs use the same
accounting), per data-parallel replica of the model:

    setting                   param  main grad  fp32 master  Adam m+v    total (d = DP size)
    fp32                        4        4          -  (param)    8      16  -> dist.  8 + 8/d
    bf16 / fp16 + fp32 masters  2        4          4             8      18  -> dist.  6 + 12/d
    bf16, no masters (old)      2        4          -             4      10  (not offered)

The main grads are fp32 in every setting (megatron DDP's grad_reduce_in_fp32 buffer); the
distributed optimizer shards what only the optimizer reads (masters, moments) over the d ranks.
With TP / EP each rank holds 1/(TP*EP) of the expert-dominated parameters on top of this.

Measured part: one optimizer step (forward, backward, megatron's optimizer) of
`qwen3-moe-tiny-deep` at fp32 and at bf16, each in a fresh process after one warm-up step
(Adam's moments exist). Peak = the most memory in use during the step above the process's
baseline before the model was built. On CUDA that is `torch.cuda.max_memory_allocated`; on CPU
torch has no allocator statistics, so glibc malloc's own (`mallinfo2`: bytes in use, heap plus
mmapped) are read after every aten op with outputs of 64 KiB or more and after every 32nd op (a
TorchDispatchMode; mallinfo2 walks malloc's bins, too slow for every op). That catches the
step's large tensors, not scratch memory inside a kernel. oneDNN is switched off on CPU unless
--onednn: its bf16 matmuls keep cached primitives and scratchpads (measured ~550 MiB for this
model), a cost of the CPU backend, not of the training state; torch's own bf16 kernels run
instead.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import warnings

warnings.filterwarnings("ignore")  # megatron's install notes at import: before the imports below

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from moe.platform.compat import cuda_available  # noqa: E402
from moe.model.memory import GIB, MIB, TRAINING_STATE, bytes_per_param  # noqa: E402, F401 (shared)
from moe.platform.parallel import init_parallel  # noqa: E402
from moe.model.policy import MoEPolicy  # noqa: E402
from moe.model.presets import get_preset  # noqa: E402
from moe.model.settings import OptimSettings, ParallelLayout, Recompute  # noqa: E402
from tools.result_table import output_into  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE_BYTES, SAMPLE_EVERY = 64 * 1024, 32  # CPU: read malloc's stats after ops this big / often
# MKL's fast memory manager keeps its GEMM buffers allocated between calls on Intel CPUs
# (measured +6.9 B/param of "persistent" state for qwen3-moe-tiny-deep fp32 on a Xeon, none on an
# AMD EPYC): a cost of the BLAS library, not of the training state, so children run without it.
CHILD_ENV = {"MKL_DISABLE_FAST_MM": "1"}

SETTINGS = TRAINING_STATE  # (name, bytes/param kept, bytes/param the dist. optimizer shards)


def table(preset_name: str, dps: list[int]) -> str:
    p = get_preset(preset_name)
    n = p.num_params()["total"]
    head = f"{'setting':<24} {'optimizer':<14} " + " ".join(f"{f'B/param dp={d}':>14}"
                                                             for d in dps)
    head += " " + " ".join(f"{f'GiB dp={d}':>11}" for d in dps)
    rows = [f"Training state per data-parallel replica of {p.name} ({n / 1e9:.2f} B params; "
            f"with TP/EP divide by the model-parallel size)", head]
    for setting, _, _ in SETTINGS:
        for distributed in (False, True):
            if setting.endswith("(old)") and distributed:
                continue
            per = [bytes_per_param(setting, d, distributed) for d in dps]
            rows.append(f"{setting:<24} {'distributed' if distributed else 'replicated':<14} "
                        + " ".join(f"{b:>14.2f}" for b in per) + " "
                        + " ".join(f"{b * n / GIB:>11.1f}" for b in per))
    return "\n".join(rows)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                 "uordblks", "fordblks", "keepcost")]


def _malloc_in_use():
    """A function returning glibc malloc's bytes in use (heap + mmapped)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError) as e:
        raise SystemExit(f"CPU measurement needs glibc >= 2.33 (mallinfo2): {e}")

    def in_use() -> int:
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd
    return in_use


def measure_one(preset_name: str, dtype_name: str, batch: int, seq: int,
                onednn: bool = False, recompute: str = "off") -> dict:
    """Peak and persistent bytes of one train step (this process; see the docstring)."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    init_parallel(1, 1, seed=0)
    cuda = cuda_available()
    in_use = torch.cuda.memory_allocated if cuda else _malloc_in_use()
    preset = get_preset(preset_name)
    g = torch.Generator().manual_seed(0)
    tokens_BT = torch.randint(0, preset.vocab_size, (batch, seq), generator=g)
    valid_BT = torch.ones(batch, seq, dtype=torch.bool)
    onednn_was = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = onednn
    try:
        base = in_use()
        policy = MoEPolicy.build(preset, ParallelLayout(), real_vocab=preset.vocab_size,
                                 dtype=dtype, optim=OptimSettings(lr=1e-4),
                                 recompute=Recompute(None if recompute == "off" else recompute))

        def step():
            policy.zero_grad()
            loss = -policy.token_logprobs(tokens_BT, valid_BT)[:, 1:].mean()
            policy.backward(loss)
            assert policy.step()[0]

        step()  # warm-up: Adam's moments are allocated on the first update
        persistent = in_use() - base
        peak = [in_use()]

        class Sample(TorchDispatchMode):
            ops = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                Sample.ops += 1
                new = sum(t.untyped_storage().nbytes() for t in tree_flatten(out)[0]
                          if isinstance(t, torch.Tensor))
                if new >= SAMPLE_BYTES or Sample.ops % SAMPLE_EVERY == 0:  # mallinfo2 is slow
                    peak[0] = max(peak[0], in_use())
                return out

        if cuda:
            torch.cuda.reset_peak_memory_stats()
            step()
            peak[0] = torch.cuda.max_memory_allocated()
        else:
            with Sample():
                step()
    finally:
        torch.backends.mkldnn.enabled = onednn_was
    return {"dtype": dtype_name, "recompute": recompute,
            "device": "cuda" if cuda else f"cpu (oneDNN {onednn})",
            "params": sum(p.numel() for p in policy.model.module.parameters()),
            "persistent_bytes": persistent, "peak_bytes": peak[0] - base}


def measure(preset_name: str, batch: int, seq: int, onednn: bool = False,
            with_recompute: bool = False) -> list[dict]:
    """`measure_one` for fp32 and bf16 (and bf16 with recompute), each in a fresh interpreter."""
    out = []
    variants = [("fp32", "off"), ("bf16", "off")]
    variants += [("bf16", "selective"), ("bf16", "full")] if with_recompute else []
    for dtype, recompute in variants:
        cmd = [sys.executable, "-m", "tools.train_memory", "--child", dtype, "--recompute",
               recompute, "--preset", preset_name, "--batch", str(batch), "--seq", str(seq)]
        cmd += ["--onednn"] if onednn else []
        run = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT,
                             env={**os.environ, **CHILD_ENV})
        if run.returncode:
            raise SystemExit(f"measuring {dtype} {recompute} failed:\n{run.stderr[-2000:]}")
        out.append(json.loads(run.stdout.strip().splitlines()[-1]))
    return out


def report(rows: list[dict], preset_name: str, batch: int, seq: int) -> str:
    fp32 = rows[0]
    n = fp32["params"]
    lines = [f"measured on {fp32['device']}: one train step of {preset_name} ({n:,} params), "
             f"batch {batch} x {seq} tokens"]
    for r in rows:
        setting = "fp32" if r["dtype"] == "fp32" else "bf16 + fp32 masters"
        name = r["dtype"] + ("" if r["recompute"] == "off" else f" + recompute {r['recompute']}")
        lines.append(f"  {name:<26} peak {r['peak_bytes'] / MIB:7.1f} MiB "
                     f"(x{r['peak_bytes'] / fp32['peak_bytes']:.3f} of fp32); persistent "
                     f"{r['persistent_bytes'] / MIB:5.1f} MiB = {r['persistent_bytes'] / n:5.2f} "
                     f"B/param (analytic {bytes_per_param(setting):.0f}); activations + "
                     f"temporaries {(r['peak_bytes'] - r['persistent_bytes']) / MIB:6.1f} MiB")
    lines.append(f"  peak bf16 / fp32 = {rows[1]['peak_bytes'] / fp32['peak_bytes']:.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-moe-tiny-deep", help="the measured model")
    ap.add_argument("--table-preset", default="qwen3-30b-a3b")
    ap.add_argument("--dp", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--no-measure", action="store_true")
    ap.add_argument("--onednn", action="store_true", help="keep oneDNN on (CPU)")
    ap.add_argument("--with-recompute", action="store_true",
                    help="also bf16 with selective (MoE layer) and full recompute")
    ap.add_argument("--recompute", default="off", choices=["off", "selective", "full"],
                    help=argparse.SUPPRESS)
    ap.add_argument("--child", choices=["fp32", "bf16"], help=argparse.SUPPRESS)
    ap.add_argument("--readme", default=None, metavar="PATH",
                    help="also write the report between PATH's <!-- table:train_memory:begin/end "
                         "--> markers (tools/result_table.py)")
    args = ap.parse_args(argv)
    if min(args.dp) < 1 or args.batch < 1 or args.seq < 2:
        ap.error(f"--dp {args.dp} must be >= 1, --batch {args.batch} >= 1, --seq {args.seq} >= 2")
    if args.child:
        print(json.dumps(measure_one(args.preset, args.child, args.batch, args.seq,
                                     args.onednn, args.recompute)))
        return 0

    with output_into(args.readme, "train_memory"):
        print(table(args.table_preset, args.dp))
        if not args.no_measure:
            print()
            print(report(measure(args.preset, args.batch, args.seq, args.onednn,
                                 args.with_recompute), args.preset, args.batch, args.seq))
    return 0


if __name__ == "__main__":
    sys.exit(main())
