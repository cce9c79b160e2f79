"""`megatron-gspo plan`'s step time: a rollout batch's rollout, pi_old pass and train time per
GPU, from the figures experiments/gpu measured on an H100 (its `results/*.json`; the tests hold
these constants to the files), each scaling rule an assumption the plan prints.

Compute (train, pi_old, flips): the FLOPs of `MoEPreset.flops_per_token` at the row length
(3x a forward for a forward and backward, the usual MFU accounting, and the accounting of the
measured MFU) over every token of the batch, spread evenly over the N GPUs, at the MFU the
deepest measured train step reached. Recompute adds the forward of what it rebuilds. Decoding:
the measured tokens/s of each sampler at 2 layers and 64 rows, a decode step's time scaled by
the layer count, rows beyond 64 per call costing proportionally more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_gspo.rollout.backends import backend_of

PEAK_TFLOPS = 989.0  # H100 SXM dense bf16 (bench.gpu_stages.PEAK_TFLOPS)
GPU = "NVIDIA H100 80GB HBM3"
TRAIN = {"file": "experiments/gpu/results/train_l4.json", "layers": 4, "micro": 4, "B": 8,
         "T": 1024, "mfu_attn": 0.15516281405723953}
"""The deepest measured train step (4 layers of Qwen3-30B-A3B's shapes, bf16, 4 microbatches
of 8 x 1024 tokens): its MFU with attention FLOPs counted."""
DECODE = {"file": "experiments/gpu/results/rollout.json", "layers": 2, "rows": 64,
          "prompt": 64, "new_tokens": 512,
          "tokens_per_s": {"lean": 1080.1736100200283, "megatron": 1080.1736100200283,
                           "megatron_engine": 4684.8891816492605,
                           "megatron_engine_graphs": 10339.95033829267},
          "stand_in": "megatron_engine_graphs"}
"""New tokens per second of each sampler at 2 layers, 64 rows x 512 new tokens, by the key a
backend names (`rollout.sampler.Backend.measured`; the megatron decoder was not measured on the
GPU: the lean one's figure stands in); a backend without one gets `stand_in`'s."""


@dataclass(frozen=True)
class StepTime:
    """Seconds per rollout batch, per GPU."""

    rollout: float
    pi_old: float
    train: float
    assumptions: tuple[str, ...]

    @property
    def total(self) -> float:
        return self.rollout + self.pi_old + self.train


def rows_per_call(cfg, rows: int) -> int:
    """Rows one sampler call decodes: whole groups of at most `rollout.max_batch_rows` (one
    group at least), as `generate_rollouts` makes them; all `rows` when 0."""
    max_rows, group = cfg.rollout.max_batch_rows, cfg.rollout.group_size
    return min(rows, max(1, max_rows // group) * group) if max_rows else rows


def sampler_figure(cfg) -> tuple[str, float, str]:
    """(measured backend, its tokens/s, a note) for the config's sampler."""
    key = backend_of(cfg).measured(cfg)
    if key in DECODE["tokens_per_s"]:
        return key, DECODE["tokens_per_s"][key], ""
    key = DECODE["stand_in"]
    return key, DECODE["tokens_per_s"][key], \
        f"rollout.backend={cfg.rollout.backend} has no GPU figure here: {key}' stands in"


def recompute_factor(p, cfg, seq_len: int) -> tuple[float, str]:
    """Train FLOPs with recompute over those without (1 + the rebuilt forward's share / 3)."""
    granularity = cfg.model.recompute_granularity
    if granularity == "off":
        return 1.0, "no recompute"
    if granularity == "full":
        return 4 / 3, "full recompute: one more forward (x4/3)"
    per_layer = p.flops_per_token(seq_len) - 2 * p.hidden_size * p.vocab_size
    share = 0.0
    modules = cfg.model.recompute_modules
    if "moe" in modules:
        share += p.num_layers * (p.topk * 6 * p.hidden_size * p.moe_ffn_hidden_size
                                 + 2 * p.hidden_size * p.num_experts)
    if "core_attn" in modules:
        share += p.num_layers * 4 * p.num_attention_heads * p.kv_channels * seq_len
    factor = 1 + share / max(per_layer, 1) / 3
    return factor, f"selective recompute ({modules}): its forward again (x{factor:.2f})"


def step_time(p, cfg, gpus: int, dp: int, seq_len: int, real: float | None = None
              ) -> StepTime:
    """Estimated seconds of one rollout batch on each of `gpus` GPUs (`dp` data-parallel
    replicas), rows of `seq_len` positions; packed (`real`), the forwards' FLOPs those of
    rows of `real` real tokens (the assumptions still say full length: the packed column's
    caller says otherwise), the rollout unchanged (decoding runs to the longest response)."""
    P, G, new = cfg.rollout.prompts_per_batch, cfg.rollout.group_size, \
        cfg.rollout.max_new_tokens
    rate = TRAIN["mfu_attn"] * PEAK_TFLOPS * 1e12
    length = real or seq_len
    tokens = P * G * length
    forward = p.flops_per_token(length) * tokens / gpus / rate  # one forward, per GPU
    recompute, recompute_note = recompute_factor(p, cfg, length)
    passes = 1 + (cfg.train.routing_replay == "r3") + (cfg.loss.kl_coef > 0)
    flips = 1 / cfg.train.flip_every if cfg.train.flip_every else 0.0
    backend, tok_s, note = sampler_figure(cfg)
    rows = P * G // dp
    per_call = rows_per_call(cfg, rows)
    step_s = DECODE["rows"] / tok_s * p.num_layers / DECODE["layers"] \
        * max(1.0, per_call / DECODE["rows"])
    rollout = math.ceil(rows / per_call) * new * step_s
    assumptions = (
        f"compute at {TRAIN['mfu_attn']:.1%} MFU of {PEAK_TFLOPS:g} TFLOP/s: the "
        f"{TRAIN['layers']}-layer train step of {TRAIN['file']} ({GPU}, "
        f"{TRAIN['micro']} x {TRAIN['B']} x {TRAIN['T']} tokens), for forwards too; every row "
        f"at full length ({seq_len} positions), FLOPs `MoEPreset.flops_per_token`, spread "
        "evenly over the GPUs; communication (all-to-all, all-reduce) beyond what that one-GPU "
        "step holds is not counted",
        f"train: 3 forwards' FLOPs per token; {recompute_note}"
        + ("; flip measurement: one no-grad forward per measured step "
           f"(train.flip_every={cfg.train.flip_every})" if flips else ""),
        f"pi_old pass: {passes} no-grad forward{'s' if passes > 1 else ''} of the batch (pi_old"
        + (", R3's replayed pi_old" if cfg.train.routing_replay == "r3" else "")
        + (", the KL reference" if cfg.loss.kl_coef > 0 else "") + ")",
        f"rollout: {backend} at {tok_s:,.0f} new tokens/s ({DECODE['file']}, "
        f"{DECODE['layers']} layers, {DECODE['rows']} rows x {DECODE['new_tokens']} tokens), a "
        f"decode step's time x layers / {DECODE['layers']}, the same per step up to "
        f"{DECODE['rows']} rows per call, proportional above; every response "
        f"rollout.max_new_tokens={new} long; {rows} rows per DP rank in calls of {per_call}"
        + (f"; {note}" if note else "")
        + ("; EP > 1: the decode steps' all-to-alls are not in the figure"
           if cfg.model.ep > 1 else ""))
    return StepTime(rollout=rollout, pi_old=passes * forward,
                    train=(3 * recompute + flips) * forward, assumptions=assumptions)
