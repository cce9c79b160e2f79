"""Cold-start SFT: teach the policy the task's format and part of its skill before RL.

Shape legend: B sequences, T tokens.

Cross-entropy on the reference answer (and <eos>) given `<bos> prompt`, token-mean over the
batch. The GSPO paper starts RL from a cold-start fine-tuned model; here SFT is run only until
the policy is partially right (`eval/accuracy` well inside (0, 1)), so that groups of G samples
have non-zero reward variance and RL has something to learn.
"""

from __future__ import annotations

import torch

from megatron_gspo.jobs.band import AccuracyBandError, SFTBand, fmt_band
from megatron_gspo.config.schema import RunConfig
from megatron_gspo.run.metrics import format_progress
from megatron_gspo.dist import reduce_metrics
from megatron_gspo.run import seeds
from megatron_gspo.run.oom import SFT_STEP, out_of_memory
from megatron_gspo.run.preempt import Preempted, Preemption
from megatron_gspo.run.resume import save_state, try_resume
from megatron_gspo.run.setup import evaluate_runtime, setup_runtime


def sft_batch(tokenizer, examples) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens/valid [B, T] of `<bos> prompt answer <eos>`, each row left-padded to the longest
    row, and the answer mask. T is the longest row, not the longest prompt plus the longest
    answer (that sum can exceed model.max_seq_len when every row fits)."""
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    rows = [(bos + tokenizer.encode(ex.prompt), tokenizer.encode(ex.answer) + [tokenizer.eos_id])
            for ex in examples]
    T = max(len(p) + len(a) for p, a in rows)
    tokens_BT = torch.full((len(rows), T), tokenizer.pad_id, dtype=torch.long)
    valid_BT = torch.zeros(len(rows), T, dtype=torch.bool)
    target_BT = torch.zeros(len(rows), T, dtype=torch.bool)
    for b, (prompt, answer) in enumerate(rows):
        tokens_BT[b, T - len(prompt) - len(answer):] = torch.tensor(prompt + answer)
        valid_BT[b, T - len(prompt) - len(answer):] = True
        target_BT[b, T - len(answer):] = True
    return tokens_BT, valid_BT, target_BT


def run_sft(cfg: RunConfig) -> dict:
    """Train `cfg.sft.steps` steps, evaluating every `cfg.sft.eval_every`; save a checkpoint at
    the end (and on SIGTERM / Ctrl-C / SIGHUP, then raise `Preempted`); resume a stopped run. With
    `sft.target_accuracy` stop (and save) at the first eval inside the band instead, and raise
    `AccuracyBandError` past it or when sft.steps runs out (`megatron_gspo.jobs.band`)."""
    rt = setup_runtime(cfg, job="sft")
    try:
        return _sft_loop(rt)
    finally:
        rt.close()


def _sft_loop(rt) -> dict:
    cfg, policy, info = rt.cfg, rt.policy, rt.info
    if cfg.sft.batch_size % info.dp:
        raise ValueError(f"sft.batch_size={cfg.sft.batch_size} is not divisible by the "
                         f"data-parallel size {info.dp}")
    gen = seeds.sft_batches(cfg.seed, info.dp_rank)
    band = SFTBand(cfg)
    resumed = try_resume(rt)
    if resumed is not None:
        gen.set_state(resumed["gen"])
        metrics = resumed["eval"]
        if resumed.get("band"):  # stopped in the band: done
            if info.is_main:
                print(f"{cfg.run_dir} entered sft.target_accuracy at step "
                      f"{resumed['band']['sft/band_step']:.0f}; nothing to do", flush=True)
            return {**metrics, **resumed["band"]}
        if "eval/accuracy" in metrics:
            band.last = (resumed["step"], metrics["eval/accuracy"])
    else:
        metrics = evaluate_runtime(rt)
        if band.band is not None and band.update(0, reduce_metrics(metrics)["eval/accuracy"]):
            return _stop_in_band(rt, band, 0, metrics, gen, reduce_metrics(metrics))
        rt.logger.log(0, metrics)
    start = resumed["step"] + 1 if resumed else 1
    if start > cfg.sft.steps and info.is_main:
        print(f"{cfg.run_dir} already finished sft.steps={cfg.sft.steps}; nothing to do",
              flush=True)
    policy.train(True)
    with Preemption() as stop:
        for step in range(start, cfg.sft.steps + 1):
            with out_of_memory("an SFT step", cfg, SFT_STEP):
                metrics = sft_step(rt, gen)
            evaluated = cfg.sft.eval_every and (step % cfg.sft.eval_every == 0
                                                or step == cfg.sft.steps)
            if evaluated:
                metrics.update(evaluate_runtime(rt))
                if info.is_main:
                    print(format_progress(step, cfg.sft.steps, metrics,
                                          ("sft/loss", "eval/accuracy")), flush=True)
            reduced = reduce_metrics(metrics)
            try:
                done = bool(evaluated) and band.update(step, reduced["eval/accuracy"])
            except AccuracyBandError:  # past the band: keep what was trained, then say so
                rt.logger.log(step, reduced)
                _save(rt, step, metrics, gen)
                raise
            if done:
                return _stop_in_band(rt, band, step, metrics, gen, reduced)
            rt.logger.log(step, reduced)
            signum = stop.requested()
            if step == cfg.sft.steps or signum:
                _save(rt, step, metrics, gen)
            if signum and step < cfg.sft.steps:
                raise Preempted(signum, f"stopped at SFT step {step} of {cfg.sft.steps}; "
                                f"checkpoint saved in {cfg.run_dir}; run the same command "
                                "to resume")
    if band.band is not None:
        raise band.exhausted()
    return metrics


def _stop_in_band(rt, band: SFTBand, step: int, metrics: dict, gen, reduced: dict) -> dict:
    """Log and save the step whose eval entered sft.target_accuracy (the record included)."""
    record = band.record()
    rt.logger.log(step, {**reduced, **record})
    _save(rt, step, metrics, gen, band=record)
    if rt.info.is_main:
        print(f"SFT entered sft.target_accuracy={fmt_band(band.band)} at step {step}: "
              f"held-out accuracy {record['sft/start_accuracy']:.4f}; saved in "
              f"{rt.cfg.run_dir}", flush=True)
    return {**metrics, **record}


def _save(rt, step: int, metrics: dict, gen: torch.Generator, **extra) -> None:
    save_state(rt, step, {"job": "sft", "step": step, "eval": metrics, **extra,
                          "gen": gen.get_state()})


def sft_step(rt, gen: torch.Generator) -> dict:
    """One cross-entropy step on a fresh batch of this rank's share of `sft.batch_size`."""
    cfg, policy = rt.cfg, rt.policy
    idx = torch.randint(len(rt.train_set), (cfg.sft.batch_size // rt.info.dp,), generator=gen)
    tokens_BT, valid_BT, target_BT = sft_batch(rt.tokenizer,
                                               [rt.train_set[i] for i in idx.tolist()])
    policy.zero_grad()
    logp_BT = policy.token_logprobs(tokens_BT, valid_BT)
    target_BT = target_BT.to(logp_BT.device)
    loss = -(logp_BT * target_BT).sum() / target_BT.sum()
    policy.backward(loss)
    stepped, grad_norm = policy.step()
    return {"sft/loss": loss.item(), "train/grad_norm": grad_norm,
            "train/skipped": float(not stepped)}
