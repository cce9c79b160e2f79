"""Throughput of one GSPO iteration: ours (megatron-core MoE) vs TRL's GRPOTrainer, side by side.

    python -m bench.throughput                      # 3 warm-up + 20 measured iterations each
    python -m bench.throughput --iterations 40 --threads 2   # only on an idle machine
    python -m bench.throughput --skip-trl           # ours only
    python -m bench.throughput --set train.flip_every=1   # extra overrides for our side
    python -m bench.throughput --force-length --max-new-tokens 128   # every response 128
    python -m bench.throughput --flip-cost --set train.routing_replay=r2
    python -m bench.throughput --sweep              # lengths x batch sizes: table + PNG
                                                          # (bench/sweep.py)
    python -m bench.throughput --with-vllm          # three sides: ours, ours with vLLM
                                                    # rollouts, TRL (a head_dim-32 preset)
    python -m bench.throughput --vllm-server-tp 2   # and a fourth: vLLM as an engine server
    python -m bench.throughput --skip-trl --peak-tflops 989 --set model.dtype=bf16 \
        --set model.preset=small --force-length --max-new-tokens 128   # a GPU: ours, MFU

Needs `pip install trl transformers accelerate datasets` for the TRL side (without them the
script reports ours and says why TRL was skipped). Nothing is downloaded: the HF model is a
random `Qwen3MoeForCausalLM` built from a config with qwen3-moe-tiny's shape (parameter counts
are checked equal), the tokenizer is a character-level `PreTrainedTokenizerFast` with exactly
our `CharTokenizer`'s ids, and TRL's dataset is our Trainer's own train split (addition, 2
digits).

One iteration = sample G responses for each of P prompts (B = P*G sequences), one no-grad
pi_old forward, then the batch is split into N minibatches with one optimizer step each.
  ours: `Trainer.iteration()` and its timers: rollout = sampling + decode + reward,
        train = the N `train_step` calls (forward, loss, backward, clip, AdamW).
  TRL:  GRPOConfig(importance_sampling_level="sequence", steps_per_generation=N,
        per_device_train_batch_size=B/N, gradient_accumulation_steps=1), so one generation
        batch of B is split into N optimizer steps exactly like ours. Timed by wrapping its
        methods: rollout = `_generate` (tokenise + `model.generate` + decode); score =
        `_generate_and_score_completions` (rollout + rewards + pi_old forward + advantages);
        train = sum over the N steps of on_step_begin -> on_step_end (a TrainerCallback: forward,
        loss, backward, clip, optimizer, scheduler) minus score.
rollout tokens/s = generated response tokens (incl. <eos>) / rollout seconds;
train tokens/s   = prompt + response tokens of the B sequences (no padding) / train seconds.
Each reported number is the median over the measured iterations of the per-iteration rate.
Ours and TRL alternate iteration by iteration (ours runs at each TRL generation boundary, outside
TRL's timed sections), so slow drifts of a noisy machine hit both. No timing is asserted anywhere.

`--with-vllm`: a third side in the same alternation, our trainer with `rollout.backend=vllm`
(vLLM in this process, `megatron_gspo/rollout/vllm/sampler.py`; its precision the model's, float32,
unless `--set rollout.vllm.dtype=bf16`): rollout = weight push + the engine's sampling +
reward, the rest as ours. vLLM's CPU attention needs head_dim in {32, 64, ...}, so every side
then runs `qwen3-moe-tiny-hd32` (qwen3-moe-tiny's layer with 2 query heads / 1 KV head of dim
32). The engine replaces `torch.set_num_threads` with a no-op in the whole process; the
benchmark sets threads through the function it held before (vLLM's kernels then run on the
same thread count). Without vLLM installed the side is skipped with the reason.
`--vllm-server-tp N` (implies --with-vllm): one more side in the same alternation, vLLM as an
engine server of N tensor-parallel workers (`rollout.vllm.mode=server`,
`megatron_gspo/rollout/vllm/server.py`): rollout = weight push over the weight-sync group +
sampling in the server's processes (on CPU its workers bound to this machine's cores split
over them, `rollout.vllm.cpu_bind`; the other sides run --threads threads) + the samples,
log-probs and routes back over a socket + reward.

`--force-length`: every response is exactly max_new_tokens long on both sides (<eos> suppressed
at sampling in TRL; our sampler gets a tokenizer with no stop ids, so <eos> is an ordinary token
there), so both sides generate and train on equal token counts at any length.
`--flip-cost`: a second copy of ours with the flip instrumentation on (`train.flip_every=1`, plus
any `--set`) runs in the same alternation; the report gives its train time over ours'.
Model FLOPs: ours' train tokens/s x 3 x `MoEPreset.flops_per_token(mean sequence length)`
(matmuls of the activated weights and attention; the count torch's FlopCounterMode gives,
tests/moe/model/test_model.py); `--peak-tflops` (the device's dense peak for the run's dtype, e.g.
989 for an H100 SXM in bf16) turns it into MFU.

Threads default to 1: with 2 threads on a 2-core machine where anything else is running, OpenMP
oversubscription makes both frameworks ~100x slower and the ratio meaningless.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach the Hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402

from megatron_gspo.config.schema import load_config  # noqa: E402
from megatron_gspo.jobs.rl import Trainer  # noqa: E402
from megatron_gspo.rollout.vllm import engine as vllm_engine  # noqa: E402
from megatron_gspo.run.host import malloc_state  # noqa: E402
from bench.sweep import main as sweep  # noqa: E402
from bench.trl import build_trl, step_timer_callback, trl_rows, trl_unavailable  # noqa: E402
from tools.result_table import add_readme_args, cpu_name, output_into  # noqa: E402
from bench.throughput_table import model_flops_line, print_table, summarize  # noqa: E402

PRESET = "qwen3-moe-tiny"
VLLM_PRESET = "qwen3-moe-tiny-hd32"
"""Every side's preset under --with-vllm: vLLM's CPU attention needs head_dim >= 32."""
_set_num_threads = torch.set_num_threads
"""torch's own, held before vLLM's CPU worker replaces it with a no-op (docs/vllm.md)."""


def preset_name(args) -> str:
    return VLLM_PRESET if getattr(args, "with_vllm", False) else PRESET


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=20, help="measured iterations per framework")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured iterations first")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads for both frameworks (default 1, see above)")
    p.add_argument("--prompts", type=int, default=8, help="P: prompts per rollout batch")
    p.add_argument("--group-size", type=int, default=8, help="G: responses per prompt")
    p.add_argument("--minibatches", type=int, default=4, help="N: optimizer steps per batch")
    p.add_argument("--max-new-tokens", type=int, default=5)
    p.add_argument("--hf-experts", default=None,
                   help="HF experts_implementation (eager | grouped_mm | batched_mm); "
                        "default: transformers' own choice")
    p.add_argument("--skip-trl", action="store_true", help="measure ours only")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override for our side (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force-length", action="store_true",
                   help="every response exactly --max-new-tokens long on both sides")
    p.add_argument("--flip-cost", action="store_true",
                   help="also time ours with train.flip_every=1 (same alternation)")
    p.add_argument("--with-vllm", action="store_true",
                   help=f"also time ours with rollout.backend=vllm (same alternation); every "
                        f"side then runs {VLLM_PRESET}")
    p.add_argument("--vllm-server-tp", type=int, default=0, metavar="N",
                   help="also time ours with vLLM as an engine server of N tensor-parallel "
                        "workers (implies --with-vllm)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the summary here")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's dense peak TFLOP/s for the run's dtype: report MFU")
    p.add_argument("--sweep", action="store_true",
                   help="sweep lengths x batch sizes: the remaining flags are "
                        "bench/sweep.py's (see its --help)")
    add_readme_args(p, "point")  # e.g. a GPU run: --readme experiments/throughput/README.md
    args = p.parse_args(argv)
    if args.vllm_server_tp < 0:
        p.error(f"--vllm-server-tp={args.vllm_server_tp} must be >= 0")
    args.with_vllm = args.with_vllm or args.vllm_server_tp > 0
    for name in ("iterations", "threads", "prompts", "minibatches", "max_new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        p.error(f"--peak-tflops={args.peak_tflops} must be > 0")
    if args.warmup < 0 or args.group_size < 2:
        p.error(f"--warmup={args.warmup} must be >= 0 and --group-size={args.group_size} >= 2")
    if (args.prompts * args.group_size) % args.minibatches:
        p.error(f"--minibatches={args.minibatches} must divide prompts * group size "
                f"= {args.prompts * args.group_size}")
    return args


# ----------------------------------------------------------------------------- ours


class NoStopTokenizer:
    """A tokenizer with no stop ids: our sampler then always runs max_new_tokens steps."""

    stop_ids = frozenset()

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def build_ours(args, run_dir: str, extra: tuple = ()):
    length = [f"model.max_seq_len={args.max_new_tokens + 16}"] \
        if args.max_new_tokens + 16 > 64 else []  # 2-digit addition prompts: <= 8 tokens
    overrides = [f"run_dir={run_dir}", *length, f"seed={args.seed}",
                 f"model.preset={preset_name(args)}",
                 "task.name=addition", "task.kwargs.num_digits=2", "task.n_train=2000",
                 "task.n_eval=8", f"rollout.prompts_per_batch={args.prompts}",
                 f"rollout.group_size={args.group_size}",
                 f"rollout.max_new_tokens={args.max_new_tokens}", "loss.name=gspo",
                 f"train.num_minibatches={args.minibatches}", "train.steps=1000000",
                 "train.routing_replay=off",
                 "train.flip_every=0",  # flip instrumentation = extra forwards TRL doesn't do
                 "train.eval_every=0", "train.save_every=0", "wandb.mode=disabled",
                 "optim.lr=1e-4", "optim.grad_clip=1.0", *args.set, *extra]
    trainer = Trainer.from_config(load_config(None, overrides))
    if args.force_length:
        trainer.rt.tokenizer = NoStopTokenizer(trainer.rt.tokenizer)
        # the sampler took its stop ids when it was built: our decoders hold them as a tensor,
        # the vLLM sampler reads its tokenizer's
        sampler = trainer.rt.sampler
        if isinstance(getattr(sampler, "stop_ids", None), torch.Tensor):
            sampler.stop_ids = sampler.stop_ids[:0]
        if hasattr(sampler, "tokenizer"):
            sampler.tokenizer = trainer.rt.tokenizer
    return trainer, overrides


def ours_iteration(trainer) -> dict:
    m = trainer.iteration()
    rollout_s, train_s = m["time/rollout"], m["time/train"]
    return {"rollout_s": rollout_s, "old_s": m.get("time/old_forward", float("nan")),
            "train_s": train_s, "rollout_tokens": m["perf/rollout_tokens_per_s"] * rollout_s,
            "train_tokens": m["perf/train_tokens_per_s"] * train_s,
            "sync_s": m.get("time/weight_sync", 0.0)}


def versions() -> str:
    out = [f"torch {torch.__version__}"]
    for mod in ("megatron.core", "transformers", "trl", "accelerate", "vllm"):
        try:
            out.append(f"{mod} {__import__(mod, fromlist=['_']).__version__}")
        except Exception:  # noqa: BLE001 - an optional package may be missing or broken
            out.append(f"{mod} -")
    return ", ".join(out)


def measure(args) -> dict:
    """One side-by-side run: summaries of ours, TRL (None if skipped) and, with --flip-cost,
    ours with the flip instrumentation on, plus what the report prints about the set-up."""
    _set_num_threads(args.threads)
    total = args.warmup + args.iterations
    skip_reason = "--skip-trl" if args.skip_trl else trl_unavailable()
    vllm_skip = server_skip = None
    with tempfile.TemporaryDirectory(prefix="bench_throughput_") as tmp:
        ours_trainer, overrides = build_ours(args, os.path.join(tmp, "ours"))
        preset = ours_trainer.policy.preset  # vocab already padded like the trainer does
        runs = {"ours": (ours_trainer, [])}
        if args.flip_cost:
            runs["flip"] = (build_ours(args, os.path.join(tmp, "flip"),
                                       ("train.flip_every=1",))[0], [])
        if args.with_vllm:
            vllm_skip = vllm_unavailable()
            if vllm_skip is None:
                try:
                    runs["vllm"] = (build_ours(args, os.path.join(tmp, "vllm"),
                                               ("rollout.backend=vllm",))[0], [])
                except Exception as e:  # noqa: BLE001 - report the others without it
                    vllm_skip = f"{type(e).__name__}: {str(e).splitlines()[0]}"
            server_skip = vllm_skip
            if args.vllm_server_tp and vllm_skip is None:
                try:
                    runs["server"] = (build_ours(args, os.path.join(tmp, "server"),
                                                 server_overrides(args))[0], [])
                except Exception as e:  # noqa: BLE001 - report the others without it
                    server_skip = f"{type(e).__name__}: {str(e).splitlines()[0]}"
            _set_num_threads(args.threads)

        def run_ours() -> None:
            for trainer, rows in runs.values():
                if len(rows) < total:
                    _set_num_threads(args.threads)
                    rows.append(ours_iteration(trainer))

        trl_trainer, attn_impl = None, None
        if skip_reason is None:
            try:
                task, train_set = ours_trainer.rt.task, ours_trainer.rt.train_set  # same prompts
                cb = step_timer_callback(args.threads, args.minibatches, run_ours)
                trl_trainer = build_trl(args, preset, train_set, task, total,
                                        os.path.join(tmp, "trl"), cb)
                c = trl_trainer.model.config
                attn_impl = f"attn={c._attn_implementation}, experts={c._experts_implementation}"
            except Exception as e:  # noqa: BLE001 - report ours even if TRL cannot be built
                skip_reason = f"could not build GRPOTrainer: {type(e).__name__}: {e}"
        t0 = time.perf_counter()
        if trl_trainer is not None:
            trl_trainer.train()  # calls run_ours() at every generation boundary
        while len(runs["ours"][1]) < total:
            run_ours()
        wall = time.perf_counter() - t0
        for trainer, _ in runs.values():  # the vLLM engine: shut down, torch's patches undone
            getattr(trainer.rt.sampler, "close", lambda: None)()
    out = {name: summarize(rows[args.warmup:]) for name, (_, rows) in runs.items()}
    out["trl"] = summarize(trl_rows(trl_trainer.bench_records)[args.warmup:]) \
        if trl_trainer else None
    seq_len = round(out["ours"]["train_tokens"] / (args.prompts * args.group_size))
    out.update(train_flops_per_token=3 * preset.flops_per_token(seq_len),
               device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    out.update(skip_reason=skip_reason, vllm_skip=vllm_skip, server_skip=server_skip, wall=wall,
               attn_impl=attn_impl,
               overrides=overrides[1:],
               preset=f"{preset.name}, {preset.num_layers} layer" + "s" * (preset.num_layers > 1),
               vocab=preset.vocab_size,
               params=preset.num_params()["total"], cpu=cpu_model(), versions=versions(),
               malloc=malloc_state())
    return out


def server_overrides(args) -> tuple:
    """The engine-server side's overrides beside ours'."""
    return ("rollout.backend=vllm", "rollout.vllm.mode=server",
            f"rollout.vllm.tensor_parallel_size={args.vllm_server_tp}")


def vllm_unavailable() -> str | None:
    """Why the vLLM side cannot run here (one line), or None."""
    return vllm_engine.unavailable()


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo) and the core count."""
    return f"{cpu_name('unknown CPU')}, {os.cpu_count()} cores"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--sweep" in argv:
        return sweep([a for a in argv if a != "--sweep"])
    args = parse_args(argv)
    res = measure(args)
    with output_into(args.readme, args.marker):
        report(args, res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args),
                       **res}, f, indent=1)
    return 0


def report(args, res: dict) -> None:
    """Print the side-by-side table and the run's set-up (batch, model, machine, overrides)."""
    ours, trl = res["ours"], res["trl"]
    print_table(ours, trl, res["skip_reason"], vllm=res.get("vllm"),
                vllm_skip=res.get("vllm_skip"), with_vllm=args.with_vllm,
                server=res.get("server"), server_tp=args.vllm_server_tp,
                server_skip=res.get("server_skip"))
    if "flip" in res:
        flip = res["flip"]
        print(f"flip instrumentation (train.flip_every=1): train s/iter {flip['train_s']:.3f} vs "
              f"{ours['train_s']:.3f} without, ratio {flip['train_s'] / ours['train_s']:.2f} "
              f"(best iterations: {flip['best']['train_s'] / ours['best']['train_s']:.2f})")
    print(model_flops_line(ours["train_tps"], res["train_flops_per_token"], args.peak_tflops))
    B = args.prompts * args.group_size
    print(f"\nbatch: {args.prompts} prompts x G={args.group_size} = {B} sequences, "
          f"{args.minibatches} optimizer steps of {B // args.minibatches} per batch, "
          f"max_new_tokens={args.max_new_tokens}"
          + (" (forced: every response that long)" if args.force_length else "")
          + ", task addition(num_digits=2)")
    print(f"iterations: {args.warmup} warm-up + {args.iterations} measured per framework"
          + (", alternating " + "/".join(["ours", *(["vLLM"] if res.get("vllm") else []),
                                          *(["vLLM server"] if res.get("server") else []),
                                          *(["TRL"] if trl else [])])
             if trl or res.get("vllm") else "") + f"; wall {res['wall']:.1f}s")
    print(f"model: {res['preset']} (vocab {res['vocab']}, {res['params']} params"
          + (f"; HF Qwen3MoeForCausalLM: same count, {res['attn_impl']})"
             if res["attn_impl"] else ")"))
    print(f"machine: {res['cpu']}; torch threads: {torch.get_num_threads()} (set "
          f"{args.threads}), device: {res['device']}, {res['versions']}; host malloc "
          f"(every side, one process): {res.get('malloc', 'untuned')}")
    print(f"ours overrides: {' '.join(res['overrides'])}"
          + ("; vLLM side: the same plus rollout.backend=vllm (in-process engine, "
             "weights pushed before every rollout batch)" if args.with_vllm else "")
          + (f"; vLLM server side: the same plus {' '.join(server_overrides(args)[1:])}"
             if args.vllm_server_tp else ""))


if __name__ == "__main__":
    sys.exit(main())
