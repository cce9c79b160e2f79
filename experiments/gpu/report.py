"""Regenerate experiments/gpu/README.md from the JSON bench/gpu_session.sh wrote (results/).

    python -m experiments.gpu.report    # after copying runs/gpu_session/*.json, env.txt here

Every figure in the README comes from results/*.json and results/env.txt; the goals' verdicts
are computed here from them.
"""

from __future__ import annotations

import json
import os
import sys

from bench.gpu_report import extra_train_files, rollout_lines, train_lines

HERE = os.path.dirname(os.path.abspath(__file__))
GOAL_MFU, GOAL_ENGINE = 0.30, 10.0

HEADER = """# GPU: a train step and rollouts at Qwen3-30B-A3B's layer shapes

**Question.** On one GPU, how fast does the trainer step at real layer shapes (hidden 2048,
32 / 4 heads of 128, 128 experts top-8 of FFN 768, vocab 151,936; 2 layers, bf16 with fp32
masters), how fast do rollouts come from the lean decoder and from megatron-core's dynamic
inference engine (`moe.inference.engine`), and how often does the engine's routing disagree with the
trainer's recompute of the same tokens, per layer (the mismatch R3 removes)?

**Command** (about 6 minutes on one GPU, from the repository's root with the project
installed; [docs/gpu.md](../../docs/gpu.md) describes each stage):

    bash bench/gpu_session.sh        # env rollout train tests report -> runs/gpu_session/
    cp runs/gpu_session/*.json runs/gpu_session/env.txt runs/gpu_session/tests.log \
       experiments/gpu/results/
    python -m experiments.gpu.report # this README

Then, on the same machine right after the train stage (for the comparison): the 4-layer table,
and the baseline of the `_foreach` optimizer ops (megatron-core's own loops):

    python -m bench.gpu_stages train --out runs/gpu_session --layers 4 --name train_l4 --lengths 1024,4096
    python -m bench.gpu_stages train --out runs/gpu_session --megatron-loops --name train_megatron_loops --top 0

"""


def read(name: str):
    path = os.path.join(HERE, "results", name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f) if name.endswith(".json") else f.read()


def verdicts(train, rollout) -> list[str]:
    """The two goals, met or not, from the figures."""
    out = []
    if train and "rows" in train:
        best = max((r for r in train["rows"] if "mfu" in r), key=lambda r: r["mfu"], default=None)
        if best:
            ok = "met" if best["mfu"] >= GOAL_MFU else "not met"
            top = ", ".join(f"`{r['op']}` {r['share']:.0%}"
                            for r in train.get("profile", {}).get("rows", [])[:3])
            out.append(f"- Train MFU goal ({GOAL_MFU:.0%}): {ok}; best {best['mfu']:.1%} at "
                       f"{best.get('micro', 1)} x {best['B']} x {best['T']} (microbatches x B x T). Top three GPU costs of a step: {top}.")
    if rollout and "backends" in rollout:
        b = rollout["backends"]
        lean = b.get("lean", {}).get("tokens_per_s")
        for name in ("megatron_engine_graphs", "megatron_engine"):
            if lean and "tokens_per_s" in b.get(name, {}):
                ratio = b[name]["tokens_per_s"] / lean
                ok = "met" if ratio >= GOAL_ENGINE else "not met"
                out.append(f"- Engine goal ({GOAL_ENGINE:.0f}x the lean decoder's tokens/s at "
                           f"{rollout['B']} x {rollout['new_tokens']}): {ok}; `{name}` "
                           f"{ratio:.2f}x in this run.")
                break
    return out


def foreach_lines(train, loops) -> list[str]:
    """Step times with moe.platform.compat's `_foreach` optimizer ops over megatron-core's per-tensor
    loops, row by row (both from one machine: `--megatron-loops` right after the train stage)."""
    if not (train and loops and "rows" in train and "rows" in loops):
        return []
    key = lambda r: (r.get("micro", 1), r["B"], r["T"])  # noqa: E731
    ref = {key(r): r for r in loops["rows"] if "step_s" in r}
    lines = ["## `_foreach` optimizer ops vs megatron-core's loops (one machine)", "",
             "| M x B x T | step s, loops | step s, `_foreach` | speed-up |",
             "| --- | --- | --- | --- |"]
    lines += [f"| {' x '.join(map(str, key(r)))} | {ref[key(r)]['step_s']:.3f} | "
              f"{r['step_s']:.3f} | {ref[key(r)]['step_s'] / r['step_s']:.2f}x |"
              for r in train["rows"] if "step_s" in r and key(r) in ref]
    return lines + [""]


def render() -> str:
    env, train, rollout = read("env.txt"), read("train.json"), read("rollout.json")
    tests = read("tests.log")
    lines = [HEADER, "## Where it ran\n", "The software, on every machine (each section below names "
             "its GPU, an H100 or an H200):\n"]
    lines += [f"    {line}" for line in (env or "not run\n").strip().splitlines()
              if not line.startswith("gpu ")]
    if tests:
        summary = [line for line in tests.splitlines() if " passed" in line or " failed" in line]
        # the tests ran on the machine that wrote env.txt: its `gpu` line names the device
        where = next((line[4:] for line in (env or "").splitlines()
                      if line.startswith("gpu ")), "?")
        lines += ["", f"GPU tests (`make test-gpu`, on the {where}): "
                      f"{summary[-1] if summary else 'no summary'}"]
    lines += ["", "## Goals", "", *verdicts(train, rollout), ""]
    sections = [("Train step", train, train_lines)]
    sections += [(f"Train step, `results/{name}`", read(name), train_lines)
                 for name in extra_train_files(os.path.join(HERE, "results"))]
    for name, r, render_fn in sections + [("Rollouts", rollout, rollout_lines)]:
        lines += [f"## {name}" + (f" ({r.get('device', '?')})" if r else ""), ""]
        if r is None:
            lines.append("not run")
        elif "error" in r:
            lines.append(f"did not run: `{r['error']}`")
        else:
            lines += render_fn(r)
        lines.append("")
    lines += foreach_lines(train, read("train_megatron_loops.json"))
    lines += ["## What it means", "",
              "The engine samples the policy's own GPTModel (no weight copy) and records every "
              "MoE layer's top-k per token; its attention runs through `moe.inference.paged_attention` "
              "(plain torch over the paged cache) because no flash-attn wheel fits beside this "
              "machine's CUDA 13 torch. The mismatch tables compare, on the same sampled tokens, "
              "the sampler's routing and log-probs with the trainer's full-sequence bf16 "
              "recompute: what R3 (`train.routing_replay=r3`) replays away. The last token of "
              "each row is left out (its routing is never computed by a sampler).", "",
              "Where the train step's time goes (the profile tables): at two layers the output "
              "layer holds most of the matmul parameters, so the vocabulary's log-softmax "
              "(float32 copies of [B, T, 151,936] logits, `moe.model.logprobs`) weighs as much as the "
              "layers; with more layers the per-expert costs grow instead: megatron's "
              "`SequentialMLP` keeps each expert's weights as separate parameters, so every "
              "step stacks them for `_grouped_mm` in the forward and again in the backward "
              "(`moe.model.experts`) and adds each expert's grad on its own (`aten::copy_`, "
              "`aten::add_` by the thousand). Without TransformerEngine or Apex, megatron-core "
              "also clips and copies the optimizer's tensors one by one; `moe.platform.compat` runs that "
              "work as `_foreach` ops instead (`results/train_megatron_loops.json`: the same "
              "machine with megatron-core's loops, `--megatron-loops`). Microbatches (`M` > 1) "
              "spread the optimizer's fixed cost.", "",
              "These results predate the two changes aimed at those costs: one stacked "
              "parameter per expert weight (`moe.model.experts.StackedExperts`: the grouped GEMMs "
              "read it directly and its grads land stacked) and the sampled tokens' log-probs "
              "in float32 chunks of tokens (`moe.model.logprobs`, no [T, V] float32 copy). The "
              "command above measures today's code; until it runs again, the tables describe "
              "the per-expert layout.", ""]
    return "\n".join(lines)


def main() -> int:
    with open(os.path.join(HERE, "README.md"), "w") as f:
        f.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
