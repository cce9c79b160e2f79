"""The positive control's second series (`run.py --series rescore`): arms rerun from another
cold start, each final policy scored on the test split twice, through the noisy engine that
sampled it (`test/accuracy`) and through the trainer's clean decoder (`test/accuracy_trainer`),
which tells a network that broke from a network whose engine disagrees with it; and the
dual-clip arm (`loss.dual_clip`). Tables for `report.py`, from `results/rescore/engine/`.
"""

from __future__ import annotations

from experiments.replay_dose_response.report import ci

PAIRS = (("gspo_sl_r3", "gspo_sl"), ("grpo_sl_r3", "grpo_sl"), ("grpo_sl_dual", "grpo_sl"))
"""(with, without): R3 under pi_old = the sampler's log-probs, and the dual clip."""
LABELS = {"grpo_sl": "GRPO, pi_old = sampler's", "grpo_sl_r3": "GRPO + R3, pi_old = sampler's",
          "grpo_sl_dual": "GRPO + dual clip 3, pi_old = sampler's",
          "gspo_sl": "GSPO, pi_old = sampler's", "gspo_sl_r3": "GSPO + R3, pi_old = sampler's"}


def pm(values: list[float], fmt: str = ".3f") -> str:
    m, h = ci(values)
    if m != m:
        return "-"
    return f"{m:{fmt}}" if h != h else f"{m:{fmt}} ± {h:{fmt}}"


def excludes_zero(values: list[float]) -> str:
    """"yes" when the 95% t interval of `values` excludes 0, else "no"."""
    m, h = ci(values)
    return "yes" if h == h and abs(m) > h else "no"


def arms_table(runs: dict) -> str:
    """One row per (level, arm): collapses counted two ways, both test accuracies, the
    ratio's size (first minibatch's mean |log-ratio|, largest |log-ratio|), clipping."""
    lines = ["| level | arm | seeds | collapsed: reward < 0.01 / final below start | start acc, "
             "engine / trainer | final acc, engine | final acc, trainer | clip frac | "
             "first-minibatch abs log-ratio | largest abs log-ratio | dual-clipped |",
             "|" + " --- |" * 11]
    for (arm, level), seeds in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        v = list(seeds.values())
        lines.append(
            f"| {level:g} | {LABELS.get(arm, arm)} | {len(v)} | "
            f"{sum(x['collapsed'] for x in v)} / {sum(x['below_start'] for x in v)} | "
            f"{pm([x['start'] for x in v])} / "
            f"{pm([x.get('start_trainer', float('nan')) for x in v])} | "
            f"{pm([x['final'] for x in v])} | "
            f"{pm([x.get('final_trainer', float('nan')) for x in v])} | "
            f"{pm([x['clip'] for x in v], '.4f')} | {pm([x['lr0'] for x in v], '.4f')} | "
            f"{pm([x['abs_max'] for x in v], '.2f')} | {pm([x['dual'] for x in v], '.4f')} |")
    return "\n".join(lines)


def answer_table(runs: dict) -> str:
    """Per level and pair: the paired gap in final test accuracy through the engine and
    through the trainer's decoder, whether each 95% interval excludes 0, collapses."""
    lines = ["| level | comparison | seeds | gap, engine (paired) | excludes 0 | gap, trainer "
             "(paired) | excludes 0 | collapsed, with / without |", "|" + " --- |" * 8]
    for level in sorted({lv for _, lv in runs}):
        for a, b in PAIRS:
            ra, rb = runs.get((a, level), {}), runs.get((b, level), {})
            seeds = sorted(set(ra) & set(rb))
            if not seeds:
                continue
            eng = [ra[s]["final"] - rb[s]["final"] for s in seeds]
            tr = [ra[s].get("final_trainer", float("nan")) - rb[s].get("final_trainer",
                                                                       float("nan"))
                  for s in seeds]
            lines.append(f"| {level:g} | {LABELS[a]} vs {LABELS[b]} | {len(seeds)} | "
                         f"{pm(eng)} | {excludes_zero(eng)} | {pm(tr)} | {excludes_zero(tr)} | "
                         f"{sum(ra[s]['collapsed'] for s in seeds)} / "
                         f"{sum(rb[s]['collapsed'] for s in seeds)} |")
    return "\n".join(lines)
