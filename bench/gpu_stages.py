"""GPU figures at Qwen3-30B-A3B's layer shapes: a train step, and rollouts from the lean decoder
and from megatron-core's dynamic engine, with the engine's routing against the trainer's.

    python -m bench.gpu_stages train   --out DIR   # tokens/s, MFU, peak memory at 1k-4k tokens,
                                                   # and a torch.profiler table of one step
    python -m bench.gpu_stages rollout --out DIR --backends lean,megatron_engine_graphs
    python -m bench.gpu_stages report  --out DIR   # DIR/*.json -> DIR/README.md tables

Each stage writes DIR/<stage>[_<backend>].json; `report` renders every JSON there as markdown.
The model: `qwen3-30b-a3b` cut to `--layers` layers (hidden 2048, 32 / 4 heads of 128, 128
experts top-8 of FFN 768, vocab 151,936), bf16 weights with fp32 masters, random init.
MFU = 6 x N x tokens / time / peak, N the parameters one token multiplies (the active
parameters less the input embedding, a lookup); `mfu_attn` adds attention's score and value
matmuls (`MoEPreset.flops_per_token`). Peak: the H100 SXM's dense bf16 989 TFLOP/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from bench.gpu_report import PEAK_TFLOPS, report
from megatron_gspo.rollout.decoders import DecoderSampler
from megatron_gspo.rollout.sampler import SamplingParams
from moe.inference.engine import EngineSampler, routing_mismatch, to_batch
from moe.model.gpt import ParallelLayout
from moe.platform.parallel import init_parallel
from moe.model.policy import MoEPolicy, OptimSettings
from moe.model.presets import get_preset
from moe.routing.replay import current_routing

# after moe: its import hook comes before any megatron import
from megatron.core import utils as mcore_utils  # noqa: E402
from megatron.core.optimizer import clip_grads, optimizer  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def preset(name: str, layers: int, max_len: int):
    return dataclasses.replace(get_preset(name), num_layers=layers, max_seq_len=max_len)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build(args, max_len: int, optim: bool, inference_graphs: bool = False):
    """The policy (megatron DDP + Adam when `optim`) on the GPU, one process."""
    init_parallel(tp=1, ep=1, seed=args.seed, cudagraph_rng=inference_graphs)
    p = preset(args.preset, args.layers, max_len)
    t0 = time.perf_counter()
    policy = MoEPolicy.build(p, ParallelLayout(), real_vocab=p.vocab_size, seed=args.seed,
                             dtype=torch.bfloat16,
                             optim=OptimSettings(lr=1e-6) if optim else None,
                             inference_graphs=inference_graphs)
    print(f"built {p.name} x{args.layers} layers in {time.perf_counter() - t0:.1f} s",
          flush=True)
    return policy, p


def train_step(policy, tokens_BT, valid_BT, micro: int = 1) -> None:
    """One optimizer step over `micro` microbatches (the same tokens each time: timing only),
    their gradients accumulated in megatron's grad buffer as the RL and SFT steps do."""
    policy.zero_grad()
    for _ in range(micro):
        logp_BT = policy.token_logprobs(tokens_BT, valid_BT)
        policy.backward(-logp_BT[:, 1:].mean() / micro)
    policy.step()


def timed(fn, iterations: int, warmup: int) -> float:
    """Median seconds of `fn()` over `iterations` after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def matmul_params(p) -> int:
    return p.num_params()["active"] - p.vocab_size * p.hidden_size


def stage_train(args) -> dict:
    """Rows at every length with one microbatch per optimizer step, then at the first length
    with each `--micro` count above one (the optimizer's fixed cost spread over more tokens)."""
    lengths = [int(x) for x in args.lengths.split(",")]
    micros = [int(x) for x in args.micro.split(",")]
    policy, p = build(args, max(lengths), optim=True)

    if args.megatron_loops:  # the baseline: megatron-core's own per-tensor fallbacks (CUDA)
        clip_grads.l2_norm_impl = mcore_utils.local_multi_tensor_l2_norm
        clip_grads.multi_tensor_scale_impl = optimizer.multi_tensor_scale_impl = \
            mcore_utils.local_multi_tensor_scale
    rows = []
    for T, M in [(T, 1) for T in lengths] + [(lengths[0], M) for M in micros if M > 1]:
        B = max(1, args.tokens // T)
        tokens_BT = torch.randint(0, p.vocab_size, (B, T), device=DEVICE)
        valid_BT = torch.ones(B, T, dtype=torch.bool, device=DEVICE)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        try:
            s = timed(lambda: train_step(policy, tokens_BT, valid_BT, M), args.iterations,
                      args.warmup)
        except torch.OutOfMemoryError as e:
            rows.append({"B": B, "T": T, "micro": M, "error": str(e).splitlines()[0]})
            continue
        n = M * B * T
        flops_6n = 6 * matmul_params(p) * n
        flops_attn = 3 * p.flops_per_token(T) * n
        rows.append({"B": B, "T": T, "micro": M, "step_s": s, "tokens_per_s": n / s,
                     "mfu": flops_6n / s / (PEAK_TFLOPS * 1e12),
                     "mfu_attn": flops_attn / s / (PEAK_TFLOPS * 1e12),
                     "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30
                     if torch.cuda.is_available() else float("nan")})
        print(json.dumps(rows[-1]), flush=True)
    out = {"layers": args.layers, "matmul_params": matmul_params(p), "rows": rows,
           "optimizer_loops": {"megatron.core.utils": "megatron", "moe.platform.compat": "foreach"}.get(
               clip_grads.l2_norm_impl.__module__, "fused")}
    if args.top:
        T = lengths[len(lengths) // 2]
        tokens_BT = torch.randint(0, p.vocab_size, (max(1, args.tokens // T), T), device=DEVICE)
        out["profile"] = profile_step(policy, tokens_BT, torch.ones_like(tokens_BT, dtype=torch.bool),
                                      args.top)
    return out


def profile_step(policy, tokens_BT, valid_BT, top: int) -> dict:
    """torch.profiler's `top` ops by GPU time of one train step (after two untimed)."""
    for _ in range(2):
        train_step(policy, tokens_BT, valid_BT)
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 record_shapes=True) as prof:
        train_step(policy, tokens_BT, valid_BT)
        sync()
    # torch ops only, each credited with the kernels it launched itself (`self_device_time`):
    # kernel rows and record_function ranges would count the same GPU time again
    ops = [e for e in prof.key_averages() if e.device_type == DeviceType.CPU
           and "#" not in e.key and not e.key.startswith("ProfilerStep")]
    total = sum(e.self_device_time_total for e in ops) or 1.0
    ranked = sorted(ops, key=lambda e: e.self_device_time_total, reverse=True)[:top]
    rows = [{"op": e.key[:60], "calls": e.count, "gpu_ms": e.self_device_time_total / 1e3,
             "share": e.self_device_time_total / total} for e in ranked]
    copies = sorted((e for e in prof.key_averages(group_by_input_shape=True)
                     if e.key == "aten::copy_"), key=lambda e: e.self_device_time_total,
                    reverse=True)[:top // 2]
    return {"B": tokens_BT.shape[0], "T": tokens_BT.shape[1], "gpu_ms_total": total / 1e3,
            "rows": rows, "copies": [{"shapes": str(e.input_shapes)[:120], "calls": e.count,
                                      "gpu_ms": e.self_device_time_total / 1e3}
                                     for e in copies]}


class _NoStopTokenizer:
    """What `DecoderSampler` reads of a tokenizer: padding 0, no stop id (full lengths)."""

    pad_id, stop_ids = 0, {-1}


def prompts(args, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(args.seed)
    return [torch.randint(1, vocab, (args.prompt_len,), generator=g).tolist()
            for _ in range(args.batch)]


def trainer_routing(policy, tokens_BT, valid_BT):
    """The trainer's recompute: routing of every valid token and the token log-probs."""
    with torch.no_grad():
        logp_BT, cache = current_routing(policy, tokens_BT, valid_BT,
                                         n_chunks=min(4, tokens_BT.shape[0]))
    return logp_BT.cpu(), cache


def mismatch(policy, tokens_BT, valid_BT, response_BT, logp_BT, routing) -> dict:
    """Engine (or sampler) vs trainer recompute on the same tokens: routing per layer and
    log-prob difference on the response tokens."""
    train_logp_BT, cache = trainer_routing(policy, tokens_BT, valid_BT)
    resp = response_BT.bool()
    diff = (train_logp_BT[resp] - logp_BT[resp]).abs()
    out = {"logp_abs_diff_mean": float(diff.mean()), "logp_abs_diff_max": float(diff.max())}
    if routing is not None:
        # the last valid token of each row carries filler routing: compare the others
        last_BT = torch.zeros_like(valid_BT)
        last_BT[torch.arange(valid_BT.shape[0]), valid_BT.long().cumsum(1).argmax(1)] = True
        keep_N = ~last_BT[valid_BT]
        out.update(routing_mismatch(routing.ids_NLK[keep_N], cache.ids_NLK[keep_N]))
    return out


BACKENDS = ("lean", "megatron_engine", "megatron_engine_graphs")


def sampler_run(args, policy, p, backend: str, ids, max_len: int):
    """(function of max_new_tokens sampling one batch in the trainer's layout, set-up s)."""
    if backend == "lean":
        sampler = DecoderSampler(policy, _NoStopTokenizer(), "lean")

        def run(n):
            s = sampler.sample(ids, SamplingParams(max_new_tokens=n, record_routing=args.routing),
                               torch.Generator().manual_seed(args.seed))
            return s.tokens_BT, s.valid_BT, s.response_BT, s.logp_BT, s.routing
        return run, 0.0

    t0 = time.perf_counter()
    sampler = EngineSampler(policy, max_requests=args.batch, max_seq_len=max_len,
                            cuda_graphs=backend.endswith("_graphs"))
    setup_s = time.perf_counter() - t0
    return (lambda n: to_batch(sampler.generate(ids, max_new_tokens=n), 0, p.num_experts)), \
        setup_s


def stage_rollout(args, save) -> dict:
    """Each backend in turn on one model (built with megatron's inference graphs when a backend
    replays them; only the engine's graphed decode steps use them); `save(result)` after each."""
    max_len = args.prompt_len + args.new_tokens
    backends = args.backends.split(",")
    result = {"B": args.batch, "prompt": args.prompt_len, "new_tokens": args.new_tokens,
              "backends": {}}
    try:
        policy, p = build(args, max_len, optim=False,
                          inference_graphs="megatron_engine_graphs" in backends)
    except Exception as e:  # megatron's graph config refused: the other backends still run
        traceback.print_exc()
        result["backends"]["megatron_engine_graphs"] = {
            "error": f"model build: {type(e).__name__}: {e}".splitlines()[0][:300]}
        backends = [b for b in backends if b != "megatron_engine_graphs"]
        policy, p = build(args, max_len, optim=False)
    ids = prompts(args, p.vocab_size)
    for backend in backends:
        row = result["backends"][backend] = {}
        try:
            run, row["setup_s"] = sampler_run(args, policy, p, backend, ids, max_len)
            run(min(8, args.new_tokens))  # warm-up: allocator, kernels, lazy tables
            sync()
            t0 = time.perf_counter()
            tokens_BT, valid_BT, response_BT, logp_BT, routing = run(args.new_tokens)
            sync()
            row["seconds"] = time.perf_counter() - t0
            row["tokens_per_s"] = int(response_BT.sum()) / row["seconds"]
            print(backend, json.dumps(row), flush=True)
            if args.routing:
                row["vs_trainer"] = mismatch(policy, tokens_BT, valid_BT, response_BT, logp_BT,
                                             routing)
                print(backend, json.dumps(row["vs_trainer"]), flush=True)
        except Exception as e:  # the next backend still runs
            traceback.print_exc()
            row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        save(result)
    return result


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=["train", "rollout", "report"])
    ap.add_argument("--out", required=True, help="folder for <stage>.json and README.md")
    ap.add_argument("--name", default=None, help="the result's file name (DIR/<name>.json; "
                    "default: the stage's); the report renders every train*.json")
    ap.add_argument("--preset", default="qwen3-30b-a3b", help="model preset (CPU dry runs: a "
                    "tiny one)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lengths", default="1024,2048,4096", help="train: sequence lengths")
    ap.add_argument("--tokens", type=int, default=8192, help="train: tokens per step")
    ap.add_argument("--micro", default="1,4", help="train: microbatches per optimizer step "
                    "(counts above one at the first length only)")
    ap.add_argument("--megatron-loops", action="store_true", help="train: megatron-core's "
                    "per-tensor optimizer loops instead of moe.platform.compat's _foreach ops (baseline)")
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--top", type=int, default=12, help="train: profile rows (0: no profile)")
    ap.add_argument("--backends", default=",".join(BACKENDS), help="rollout: comma list of "
                    + ", ".join(BACKENDS))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--routing", action=argparse.BooleanOptionalAction, default=True,
                    help="rollout: record routing and compare with the trainer's")
    args = ap.parse_args(argv)
    if args.megatron_loops and not torch.cuda.is_available():
        ap.error("--megatron-loops: megatron-core's loops allocate on CUDA; this machine has "
                 "no GPU")
    bad = [b for b in args.backends.split(",") if b not in BACKENDS]
    if bad:
        ap.error(f"--backends={args.backends!r}: unknown {bad}; expected some of {BACKENDS}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.stage == "report":
        with open(os.path.join(args.out, "README.md"), "w") as f:
            f.write(report(args.out))
        return 0
    path = os.path.join(args.out, (args.name or args.stage) + ".json")

    def save(result: dict) -> None:
        with open(path, "w") as f:
            json.dump({**result, "device": torch.cuda.get_device_name()
                       if torch.cuda.is_available() else "cpu"}, f, indent=1)

    try:
        result = stage_train(args) if args.stage == "train" else stage_rollout(args, save)
    except Exception as e:  # recorded, so the report says what did not run and why
        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
    save(result)
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
