"""Markdown tables of the JSON `bench.gpu_stages` writes (train*.json, rollout.json), for
`python -m bench.gpu_stages report` and experiments/gpu/README.md."""

from __future__ import annotations

import glob
import json
import os

OPTIMIZER_LOOPS = {"megatron": "megatron-core's per-tensor loops",
                   "foreach": "`_foreach` ops (`moe.platform.compat.use_foreach_optimizer_kernels`)",
                   "fused": "TransformerEngine's or Apex's fused kernels"}
"""How the grad norm, clip scaling and master-to-model copies ran (`--megatron-loops`): results
written before the option were megatron-core's loops."""


PEAK_TFLOPS = 989.0
"""Dense bf16 peak of an H100 SXM (an H200's is the same), the MFU's denominator."""

FLOP_FORMULA = (
    "MFU (6N) = 6 x N x tokens/s / 989 TFLOP/s (dense bf16 peak of an H100 SXM or H200), N the "
    "matmul parameters one token multiplies (attention and output projections, router, its top-k "
    "experts, the output layer; the input embedding, a lookup, is left out); with attention adds "
    "3 x 4 x heads x head dim x T per layer for QK^T and AV over T keys (`MoEPreset."
    "flops_per_token`). TFLOP/s per GPU is the 6N figure, the one published figures for "
    "Qwen3-30B-A3B quote (vendors' formulas differ). One GPU runs every expert locally: no "
    "expert-parallel all-to-all, which a multi-GPU run of the whole model pays.")
"""The formula line under each train table (bench.gpu_stages's module docstring)."""


def train_lines(r: dict) -> list[str]:
    loops = r.get("optimizer_loops", "megatron")
    lines = [f"{r['layers']} layers, {r['matmul_params'] / 1e6:.0f} M matmul parameters per "
             "token; M microbatches of B x T tokens per optimizer step; the optimizer's "
             f"per-tensor work as {OPTIMIZER_LOOPS[loops]}\n", FLOP_FORMULA + "\n",
             "| M x B x T | step s | tokens/s per GPU | TFLOP/s per GPU (6N) | MFU (6N) | "
             "MFU with attention | peak GiB |", "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {x.get('micro', 1)} x {x['B']} x {x['T']} | " + (f"{x['error']} |" if "error" in x else
              f"{x['step_s']:.3f} | {x['tokens_per_s']:,.0f} | {x['mfu'] * PEAK_TFLOPS:.0f} | "
              f"{x['mfu']:.1%} | {x['mfu_attn']:.1%} | {x['peak_gib']:.1f} |") for x in r["rows"]]
    if "profile" in r:
        pr = r["profile"]
        lines += ["", f"torch.profiler, one step at {pr['B']} x {pr['T']}: "
                  f"{pr['gpu_ms_total']:.1f} ms of GPU time\n", "| op | calls | GPU ms | share |",
                  "| --- | --- | --- | --- |"]
        lines += [f"| `{x['op']}` | {x['calls']} | {x['gpu_ms']:.1f} | {x['share']:.1%} |"
                  for x in pr["rows"]]
        if pr.get("copies"):
            lines += ["", "`aten::copy_` by input shapes\n", "| shapes | calls | GPU ms |",
                      "| --- | --- | --- |"]
            lines += [f"| `{x['shapes']}` | {x['calls']} | {x['gpu_ms']:.1f} |"
                      for x in pr["copies"]]
    return lines


def rollout_lines(r: dict) -> list[str]:
    lines = [f"{r['B']} sequences x {r['new_tokens']} new tokens after {r['prompt']}-token "
             "prompts\n", "| backend | set-up s | sampling s | new tokens/s | vs lean |",
             "| --- | --- | --- | --- | --- |"]
    lean = r["backends"].get("lean", {}).get("tokens_per_s")
    for name, x in r["backends"].items():
        if "error" in x:
            lines.append(f"| {name} | did not run: `{x['error']}` | | | |")
            continue
        ratio = f"{x['tokens_per_s'] / lean:.2f}x" if lean else "-"
        lines.append(f"| {name} | {x['setup_s']:.1f} | {x['seconds']:.2f} | "
                     f"{x['tokens_per_s']:,.0f} | {ratio} |")
    for name, x in r["backends"].items():
        v = x.get("vs_trainer")
        if not v:
            continue
        lines.append(f"\n{name} vs the trainer's recompute of the same tokens: |log-prob "
                     f"difference| mean {v['logp_abs_diff_mean']:.3g}, max "
                     f"{v['logp_abs_diff_max']:.3g}")
        if "set" in v:
            lines += [f"; tokens whose top-k differs in at least one layer: {v['any_layer']:.1%}"
                      "\n", "| layer | top-k set differs | expert activations differ |",
                      "| --- | --- | --- |"]
            lines += [f"| {i:02d} | {a:.2%} | {b:.2%} |"
                      for i, (a, b) in enumerate(zip(v["set"], v["expert"]))]
    return lines


def extra_train_files(out_dir: str) -> list[str]:
    """The train_*.json names in `out_dir` (variants: `bench.gpu_stages train --name`), sorted."""
    return sorted(os.path.basename(f) for f in glob.glob(os.path.join(out_dir, "train_*.json")))


def report(out_dir: str) -> str:
    """Markdown of every stage JSON in `out_dir` (train.json, train_*.json, rollout.json)."""
    lines = []
    extra = [name[:-len(".json")] for name in extra_train_files(out_dir)]
    for name, render in [("train", train_lines), *[(n, train_lines) for n in extra],
                         ("rollout", rollout_lines)]:
        path = os.path.join(out_dir, name + ".json")
        if not os.path.exists(path):
            lines += [f"### {name}\n", "not run\n"]
            continue
        with open(path) as f:
            r = json.load(f)
        lines += [f"### {name} ({r.get('device', '?')})\n"]
        lines += [f"did not run: `{r['error']}`"] if "error" in r else render(r)
        lines.append("")
    return "\n".join(lines)
