"""bench/throughput.py's report: per-side medians over the measured iterations, the side-by-side
Markdown table with its ratios, and the model-FLOPs line (plain Python: no torch).
"""

from __future__ import annotations

import statistics


def summarize(rows: list) -> dict:
    med = statistics.median
    rollout = [r["rollout_tokens"] / r["rollout_s"] for r in rows]
    train = [r["train_tokens"] / r["train_s"] for r in rows]
    return {"spread": f"rollout {min(rollout):.0f}-{max(rollout):.0f}, "
                      f"train {min(train):.0f}-{max(train):.0f} tokens/s",
            "rollout_tps": med(r["rollout_tokens"] / r["rollout_s"] for r in rows),
            "train_tps": med(r["train_tokens"] / r["train_s"] for r in rows),
            "rollout_s": med(r["rollout_s"] for r in rows), "old_s": med(r["old_s"] for r in rows),
            "sync_s": med(r.get("sync_s", 0.0) for r in rows),
            "train_s": med(r["train_s"] for r in rows),
            "rollout_tokens": statistics.mean(r["rollout_tokens"] for r in rows),
            "train_tokens": statistics.mean(r["train_tokens"] for r in rows),
            # the least disturbed iteration (the sweep's statistic on a shared machine)
            "best": {"rollout_tps": max(rollout), "train_tps": max(train),
                     "old_s": min(r["old_s"] for r in rows),
                     "train_s": min(r["train_s"] for r in rows)}}


ROWS = [("rollout tokens/s", "rollout_tps", "{:.1f}"),
        ("train tokens/s", "train_tps", "{:.1f}"),
        ("rollout s/iter", "rollout_s", "{:.3f}"),
        ("weight push s/iter (in rollout)", "sync_s", "{:.3f}"),
        ("pi_old pass s/iter", "old_s", "{:.3f}"),
        ("train s/iter", "train_s", "{:.3f}"),
        ("rollout tokens/iter (mean)", "rollout_tokens", "{:.1f}"),
        ("train tokens/iter (mean)", "train_tokens", "{:.1f}")]


def _ratio(a: dict | None, b: dict | None, key: str) -> str:
    if a is None or b is None or not b.get(key) or a.get(key) is None:
        return "-"
    return f"{a[key] / b[key]:.2f}"


def format_table(ours: dict, trl: dict | None, skip_reason: str | None,
                 vllm: dict | None = None, vllm_skip: str | None = None,
                 with_vllm: bool = False, server: dict | None = None,
                 server_tp: int = 0, server_skip: str | None = None) -> str:
    """The side-by-side Markdown table (with `with_vllm`, three sides and three ratios; with
    `server_tp`, a vLLM engine-server side and its ratios to ours and to the in-process
    engine), the spread line and why a side was skipped."""
    sides = [("ours (megatron-core)", ours)]
    if with_vllm:
        sides = [("ours (megatron-core, lean decoder)", ours), ("ours + vLLM rollouts", vllm)]
    if server_tp:
        sides.append((f"ours + vLLM server (TP={server_tp})", server))
    sides.append(("TRL GRPOTrainer", trl))
    ratios = [("ours/TRL", "ours", "trl")]
    if with_vllm:
        ratios += [("vLLM/TRL", "vllm", "trl"), ("vLLM/ours", "vllm", "ours")]
    if server_tp:
        ratios += [("server/ours", "server", "ours"), ("server/vLLM", "server", "vllm")]
    by_name = {"ours": ours, "trl": trl, "vllm": vllm, "server": server}
    engines = [side for side in (vllm, server) if side is not None]
    cols = ["metric (median per iteration)", *(n for n, _ in sides), *(n for n, _, _ in ratios)]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for label, key, fmt in ROWS:
        if key == "sync_s" and not with_vllm:
            continue
        cells = []
        for _, side in sides:
            if side is None:
                cells.append("skipped")
            elif key == "sync_s" and not any(side is e for e in engines):
                cells.append("-")
            else:
                cells.append(fmt.format(side[key]))
        cells += ["-" if key == "sync_s" else _ratio(by_name[a], by_name[b], key)
                  for _, a, b in ratios]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    spread = [f"ours {ours['spread']}"] + ([f"vLLM {vllm['spread']}"] if vllm else []) \
        + ([f"vLLM server {server['spread']}"] if server else []) \
        + ([f"TRL {trl['spread']}"] if trl else [])
    lines += ["", "min-max over iterations: " + "; ".join(spread)]
    if skip_reason:
        lines.append(f"TRL skipped: {skip_reason}")
    if with_vllm and vllm_skip:
        lines.append(f"vLLM skipped: {vllm_skip}")
    if server_tp and server_skip:
        lines.append(f"vLLM server skipped: {server_skip}")
    return "\n".join(lines)


def print_table(ours: dict, trl: dict | None, skip_reason: str | None, **vllm_side) -> None:
    print(format_table(ours, trl, skip_reason, **vllm_side))


def model_tflops(train_tps: float, flops_per_token: int,
                 peak_tflops: float | None) -> tuple[float, float | None]:
    """(train model TFLOP/s, MFU in % of `peak_tflops` or None)."""
    tflops = train_tps * flops_per_token / 1e12
    return tflops, (100 * tflops / peak_tflops if peak_tflops else None)


def model_flops_line(train_tps: float, flops_per_token: int, peak_tflops: float | None) -> str:
    """ours' train model TFLOP/s (and MFU against `peak_tflops`), one line."""
    tflops, mfu = model_tflops(train_tps, flops_per_token, peak_tflops)
    mfu = f"; MFU {mfu:.2f}% of {peak_tflops:g} TFLOP/s" if mfu is not None else ""
    return (f"ours train: {tflops:.4g} model TFLOP/s ({flops_per_token:,} FLOPs per token, "
            f"3 x moe.model.presets.flops_per_token){mfu}")
