"""`megatron-gspo plan [--config F.yaml] [key=value ...] --gpus N --gpu-mem-gib M`: before any
GPU is spent, the per-GPU memory of the layout a config names, whether it fits, which layouts of
N GPUs fit, and an estimated step time; every assumption printed. No torch, no model: seconds.

Memory (`moe.model.memory`, the accounting tools/train_memory and tools/replay_memory use): the
training state (weights, fp32 main grads, fp32 masters and Adam moments, with and without the
distributed optimizer), the routing caches the trainer keeps for a rollout batch, then the
largest of three phases, which never overlap: the rollout (what the backend declares,
`megatron_gspo.rollout.sampler.Backend.plan_memory`: the KV-cache sampler's cache and its
stacked expert weights, an engine's buffer; an in-process engine's own weights and cache stay
for the whole step), the pi_old pass (one no-grad forward of `train.logprob_max_tokens`) and the
train step (one microbatch of `train.micro_max_tokens`: saved layers under the recompute
setting, the log-prob's backward, a layer's backward). It fits when that peak is at most `HEADROOM` of the
GPU's memory. Time: `plan_time`.

A layout that cannot exist is one line and exit status 2 (`check_layout`: the config's own rules
and its backend's, `rollout.backends.check_config`; `MoEPreset.check_parallel`, N a multiple of
TP and EP, the batch split over DP); a plan that does not fit exits 1.
"""

from __future__ import annotations

import dataclasses
import os
import textwrap
from dataclasses import dataclass

from megatron_gspo.config.schema import RunConfig, local_prompts
from megatron_gspo.errors import ConfigError
from megatron_gspo.jobs.plan_packed import (Column, RowSizes, packed_assumption, packed_lines,
                                           packed_sizes)
from megatron_gspo.jobs.plan_time import rows_per_call, step_time
from megatron_gspo.rollout.backends import backend_of, check_config
from moe.model import memory as mem
from moe.hf.config import preset_from_hf
from moe.model.presets import get_preset

HEADROOM = 0.9
"""Share of a GPU's memory the plan may fill: the rest is for the CUDA context, NCCL's buffers
and the caching allocator's fragmentation."""
GIB = mem.GIB
WIDTH = 100  # the report's line width


@dataclass(frozen=True)
class Plan:
    """The per-GPU memory of one layout, by row (label, bytes), and what it adds up to."""

    cfg: RunConfig
    gpus: int
    rows: tuple[tuple[str, float], ...]
    state: dict
    state_other: dict
    """The training state with the other distributed-optimizer setting."""
    persistent: float
    phases: dict
    """phase -> its rows' bytes."""
    facts: dict
    packed: "Column | None" = None
    """The same rows at packed lengths (`train.pack` and a mean response length), or None."""

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    @property
    def peak(self) -> float:
        return self.persistent + self.phases[self.peak_phase]

    def peak_with(self, state: dict) -> float:
        return self.peak - sum(self.state.values()) + sum(state.values())


def model_preset(cfg: RunConfig):
    """(preset, note): model.hf_path's config.json when the folder exists, else model.preset
    (model.num_layers, model.max_seq_len applied) and a note saying so."""
    note = ""
    if cfg.model.hf_path and os.path.isdir(cfg.model.hf_path):
        p = preset_from_hf(cfg.model.hf_path)
    else:
        p = get_preset(cfg.model.preset)
        if cfg.model.num_layers:
            p = dataclasses.replace(p, num_layers=cfg.model.num_layers)
        if cfg.model.hf_path:
            note = (f"model.hf_path={cfg.model.hf_path} does not exist here: sized from "
                    f"model.preset={cfg.model.preset}")
    if cfg.model.max_seq_len:
        p = dataclasses.replace(p, max_seq_len=cfg.model.max_seq_len)
    return p, note


def padded(p, cfg: RunConfig, tp: int):
    """The preset with its vocabulary padded as the run pads it for `tp` ranks."""
    multiple = (cfg.model.vocab_multiple if cfg.model.hf_path else 16) * tp
    return p.with_vocab(p.vocab_size, multiple=multiple)


def row_length(p, cfg: RunConfig) -> tuple[int, int]:
    """(positions of a row, its response positions): every row at full length, the prompt
    `data.max_prompt_tokens` (default: the model's length less the response)."""
    new = cfg.rollout.max_new_tokens
    prompt = cfg.data.max_prompt_tokens or max(1, p.max_seq_len - new)
    return min(prompt + new, max(p.max_seq_len, new + 1)), new


def with_layout(cfg: RunConfig, tp: int, ep: int) -> RunConfig:
    """`cfg` at TP x EP (sequence parallelism as TP requires), through the config's checks."""
    model = dataclasses.replace(cfg.model, tp=tp, ep=ep, sequence_parallel=tp > 1)
    return dataclasses.replace(cfg, model=model)


def check_layout(p, cfg: RunConfig, gpus: int) -> None:
    """ConfigError, one line naming the values, for a layout that cannot exist on `gpus`."""
    tp, ep = cfg.model.tp, cfg.model.ep
    check_config(cfg)
    for key, value in (("model.tp", tp), ("model.ep", ep)):
        if gpus % value:
            raise ConfigError(f"--gpus {gpus} is not a multiple of {key}={value}")
    try:
        padded(p, cfg, tp).check_parallel(tp, ep)
    except ValueError as e:
        raise ConfigError(f"model.tp={tp} model.ep={ep}: {e}") from None
    local_prompts(cfg, gpus // tp)


def plan_layout(p, cfg: RunConfig, gpus: int, mean_response: float | None = None) -> Plan:
    """The per-GPU memory of `cfg`'s layout on `gpus` GPUs (`check_layout` first); with
    `mean_response` (tokens) and `train.pack`, also at packed lengths (`Plan.packed`)."""
    check_layout(p, cfg, gpus)
    m, r = cfg.model, cfg.rollout
    tp, ep, sp = m.tp, m.ep, m.sequence_parallel
    q = padded(p, cfg, tp)
    dp, edp = gpus // tp, gpus // ep
    setting = mem.DTYPE_SETTING[m.dtype]
    params = mem.params_per_rank(q, tp, ep)
    state = mem.state_bytes(params, setting, dp, edp, cfg.optim.distributed)
    other = mem.state_bytes(params, setting, dp, edp, not cfg.optim.distributed)
    T, new = row_length(q, cfg)
    rows = local_prompts(cfg, dp) * r.group_size
    caches = 1 + (cfg.train.routing_replay == "r3")
    head = [(f"weights ({m.dtype})", state["weights"]),
            ("grads (fp32 main grads)", state["grads"]),
            (f"fp32 masters ({_dist(cfg)}; else {other['masters'] / GIB:.2f})",
             state["masters"]),
            (f"Adam moments ({_dist(cfg)}; else {other['optimizer'] / GIB:.2f})",
             state["optimizer"])]
    engine, whole_step = backend_of(cfg).plan_memory(q, cfg, rows_per_call(cfg, rows), T)
    full = _sized(q, cfg, rows, RowSizes(T, new), caches, engine, whole_step)
    out = head + [(label, b) for label, b in full[0]]
    packed = None
    if mean_response is not None and cfg.train.pack:
        rows_packed, persistent, phases = _sized(q, cfg, rows, packed_sizes(T, new,
                                                 mean_response), caches, engine, whole_step)
        packed = Column(tuple(b for _, b in head + rows_packed),
                        sum(state.values()) + persistent, phases)
    facts = {"dp": dp, "edp": edp, "rows": rows, "T": T, "new": new, "preset": q,
             "micro": _micro_rows(cfg, rows, T), "per_call": rows_per_call(cfg, rows)}
    return Plan(cfg, gpus, tuple(out), state, other, sum(state.values()) + full[1], full[2],
                facts, packed)


def _sized(q, cfg: RunConfig, rows: int, sizes: RowSizes, caches: int, engine: list,
           whole_step: bool) -> tuple[list, float, dict]:
    """(rows after the training state, their persistent bytes, phase -> bytes) at `sizes`."""
    m, a = cfg.model, mem.ITEMSIZE[cfg.model.dtype]
    routed = sizes.routed(rows, m.tp if m.sequence_parallel else 1, cfg.train.pack)
    out = [("routing caches: pi_old's" + (" and the sampler's (R3)" if caches > 1 else ""),
            caches * mem.replay_cache_bytes(int(routed), q.num_layers, q.topk, q.num_experts))]
    persistent = out[0][1]
    if whole_step:
        out += engine
        persistent += sum(b for _, b in engine)
        engine = []
    phases = {}
    phase_rows = {"rollout": engine, "pi_old": _old_pass_rows(q, cfg, rows, sizes, a),
                  "train": _train_rows(q, cfg, rows, sizes, a)}
    for phase, items in phase_rows.items():
        out += [(f"{phase}: {label}", b) for label, b in items]
        phases[phase] = sum(b for _, b in items)
    return out, persistent, phases


def _dist(cfg: RunConfig) -> str:
    return "distributed" if cfg.optim.distributed else "replicated"


def _rows(n: float) -> str:
    return f"{n:g} row" + ("" if n == 1 else "s")


def _micro_rows(cfg: RunConfig, rows: int, T: int) -> int:
    minibatch = rows // cfg.train.num_minibatches
    budget = cfg.train.micro_max_tokens
    return minibatch if not budget else min(minibatch, max(1, budget // T))


def _old_pass_rows(q, cfg: RunConfig, rows: int, sizes: RowSizes, a: int) -> list:
    m = cfg.model
    n, T, new = sizes.forward(rows, cfg.train.logprob_max_tokens)
    return [(f"no-grad forward ({_rows(n)} x {T})",
             mem.forward_memory(q, n, T, new, a, m.tp, m.ep, m.sequence_parallel))]


def _train_rows(q, cfg: RunConfig, rows: int, sizes: RowSizes, a: int) -> list:
    m = cfg.model
    n, T, new = sizes.forward(rows // cfg.train.num_minibatches, cfg.train.micro_max_tokens)
    modules = tuple(s.strip() for s in m.recompute_modules.split(","))
    s = mem.train_step_memory(q, n, T, new, a, m.tp, m.ep, m.sequence_parallel,
                              m.recompute_granularity, modules)
    out = [(f"saved layers ({_rows(n)} x {T} per microbatch, recompute "
            f"{m.recompute_granularity})", s.layers), ("residual-stream copies", s.hidden)]
    if s.logits >= s.layer_backward:
        out.append(("log-prob backward (logits, their grad, fp32 chunks)", s.logits))
    else:
        out.append(("a layer's backward (rebuilt part, grads, stacked experts)",
                    s.layer_backward))
    if cfg.train.routing_replay != "off":
        tokens = n * T / (m.tp if m.sequence_parallel else 1)
        out.append(("replayed routes (int64, one forward)", tokens * q.num_layers * q.topk * 8))
    return out


def layouts(p, cfg: RunConfig, gpus: int, limit: float, mean_response: float | None = None
            ) -> list[tuple]:
    """(tp, ep, peak bytes, fits, packed peak bytes or None) of every layout of `gpus` GPUs
    the config's rules allow, the config's other settings kept; TP first, then EP,
    ascending."""
    out = []
    for tp in _divisors(gpus):
        for ep in _divisors(gpus):
            try:
                plan = plan_layout(p, with_layout(cfg, tp, ep), gpus, mean_response)
            except ConfigError:
                continue
            out.append((tp, ep, plan.peak, plan.peak <= limit,
                        plan.packed and plan.packed.peak))
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def pick(candidates: list) -> tuple[int, int] | None:
    """The fitting layout with the fewest tensor-parallel ranks (the KV-cache sampler and R3
    need TP = 1), then the fewest expert-parallel ones (all-to-alls over fewer GPUs)."""
    return next(((tp, ep) for tp, ep, _, fits, *_ in candidates if fits), None)


def report(source: str, cfg: RunConfig, gpus: int, gpu_gib: float,
           mean_response: float | None = None) -> tuple[str, bool]:
    """The plan's text and whether the config's layout fits (at full length, the bound); with
    `mean_response` (tokens) and `train.pack`, a packed column beside the full-length one."""
    p, note = model_preset(cfg)
    plan = plan_layout(p, cfg, gpus, mean_response)
    limit = HEADROOM * gpu_gib * GIB
    f, q, m = plan.facts, plan.facts["preset"], cfg.model
    n = q.num_params()
    lines = [f"megatron-gspo plan: {source} on {gpus} GPUs of {gpu_gib:g} GiB",
             f"model {q.name}: {n['total'] / 1e9:.2f} B parameters, {n['active'] / 1e9:.2f} B "
             f"active per token" + (f" ({note})" if note else ""),
             f"layout: TP {m.tp} x EP {m.ep}, DP {f['dp']}, expert-DP {f['edp']}, "
             f"{q.num_experts // m.ep} of {q.num_experts} experts per GPU; {m.dtype}"
             + (" with fp32 masters" if m.dtype != "fp32" else "") + f", {_dist(cfg)} optimizer",
             f"rows: {f['rows']} per DP rank of {f['T']} positions ({f['T'] - f['new']} prompt "
             f"+ {f['new']} response), minibatch {f['rows'] // cfg.train.num_minibatches}, "
             f"microbatch {f['micro']}, sampled {f['per_call']} per call"]
    lines += packed_lines(plan, cfg, mean_response) + [""]
    lines += _memory_lines(plan, cfg, gpu_gib, limit)
    lines += _layout_lines(p, cfg, gpus, limit, mean_response)
    t = step_time(q, cfg, gpus, f["dp"], f["T"])
    real = plan.packed and packed_sizes(f["T"], f["new"], mean_response).real
    tp_ = step_time(q, cfg, gpus, f["dp"], f["T"], real=real) if real else None
    lines += ["", "step time per rollout batch (estimate)" + (", full length | packed"
                                                                if tp_ else "")]
    lines += [f"  {name:<10}{s:>12,.0f} s" + (f" | {sp:>10,.0f} s" if tp_ else "")
              for name, s, sp in (("rollout", t.rollout, tp_ and tp_.rollout),
                                  ("pi_old", t.pi_old, tp_ and tp_.pi_old),
                                  ("train", t.train, tp_ and tp_.train))]
    lines += [f"  {'total':<10}{t.total:>12,.0f} s ({t.total / 3600:.1f} h)"
              + (f" | {tp_.total:>10,.0f} s ({tp_.total / 3600:.1f} h)" if tp_ else ""), "",
              "assumptions"]
    lines += [f"  - {a}" for a in _memory_assumptions(cfg, note) + list(t.assumptions)
              + ([packed_assumption(real)] if tp_ else [])]
    return "\n".join(_wrapped(lines)), plan.peak <= limit


def _memory_lines(plan: Plan, cfg: RunConfig, gpu_gib: float, limit: float) -> list[str]:
    """The per-GPU table (full length, and packed beside it), its peak and whether it fits."""
    packed = plan.packed
    lines = [f"{'per GPU':<68}{'GiB':>8}" + (f"{'packed':>10}" if packed else "")]
    lines += [f"  {label:<66}{b / GIB:>8.2f}" + (f"{pb / GIB:>10.2f}" if packed else "")
              for (label, b), pb in zip(plan.rows, packed.values if packed else plan.rows)]
    fits = plan.peak <= limit
    lines += [f"  {'peak: state + caches + the ' + plan.peak_phase + ' phase':<66}"
              f"{plan.peak / GIB:>8.2f}" + (f"{packed.peak / GIB:>10.2f}" if packed else ""),
              f"  {'fits' if fits else 'does not fit'}: at most {HEADROOM:.0%} of {gpu_gib:g} "
              f"GiB ({limit / GIB:.1f}) may be used; with the "
              f"{'replicated' if cfg.optim.distributed else 'distributed'} optimizer instead: "
              f"{plan.peak_with(plan.state_other) / GIB:.2f} GiB"]
    if packed:
        lines.append(f"  packed: {'fits' if packed.peak <= limit else 'does not fit'} at the "
                     "mean response (the full-length column is the bound)")
    return lines + [""]


def _wrapped(lines: list[str], width: int = WIDTH) -> list[str]:
    """Lines longer than `width` wrapped, continued under their text."""
    out = []
    for line in lines:
        if len(line) <= width:
            out.append(line)
            continue
        lead = len(line) - len(line.lstrip(" -*"))
        out += textwrap.wrap(line, width, subsequent_indent=" " * max(lead, 2),
                             break_on_hyphens=False)
    return out


def _layout_lines(p, cfg: RunConfig, gpus: int, limit: float,
                  mean_response: float | None = None) -> list[str]:
    candidates = layouts(p, cfg, gpus, limit, mean_response)
    chosen = pick(candidates)
    packed = any(c[4] is not None for c in candidates)
    out = [f"layouts of {gpus} GPUs (the config's other settings); * = the pick: the fitting "
           "layout with the fewest TP, then EP ranks", "  TP  EP  peak GiB  fits"
           + ("  packed GiB" if packed else "")]
    out += [f"{'*' if (tp, ep) == chosen else ' '} {tp:>3} {ep:>3} {peak / GIB:>9.2f}  "
            + (f"{'yes' if ok else 'no':<4}{pk / GIB:>12.2f}" if packed else
               ('yes' if ok else 'no'))
            for tp, ep, peak, ok, pk in candidates]
    if chosen is None:
        out.append("  none fits: lower the batch knobs (train.micro_max_tokens, "
                   "rollout.max_batch_rows), recompute more, or add GPUs")
    return out


def _memory_assumptions(cfg: RunConfig, note: str) -> list[str]:
    out = [note] if note else []
    return out + [
        "every row at full length (prompt data.max_prompt_tokens or model length less the "
        "response, response rollout.max_new_tokens): an upper bound",
        "activations and logits `moe.model.memory` (the local layer spec, fused SDPA as on a GPU; "
        "within 1% of the H100 steps experiments/gpu measured), routing balanced over the "
        "experts",
        "the phases (rollout, pi_old pass, train step) never overlap; their buffers are freed "
        "between them (the caching allocator reuses them)"]
