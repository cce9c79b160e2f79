"""The "lean" and "megatron" samplers: our own KV-cache decoders over the policy's weights.

Shape legend: B sequences, P prompt columns, T total columns, V vocab.

Each step appends one column to every row: the prompt columns are prefilled once, then each
step runs the model on the new column only (`moe.inference.decode.kv_decoder`: "lean" walks megatron's
layers itself, "megatron" runs `GPTModel.forward` with megatron-core's static inference
context; same logits to fp32 rounding). With `rollout.decoders.kv_cache=false`, or under sequence
parallelism (which megatron-core requires for MoE with TP > 1), each step recomputes the full
forward instead. With `record_routing` (R3) the decoder records every MoE layer's top-k as it
goes, plus one last decode step for the final sampled column: the routing the sampler used.

Each step's temperature, log-softmax, top-p and draw run where the logits are (on a GPU: no
[B, V] copy to the host per token, 39 MB at B=64 and Qwen3's 151,936-token vocabulary); only the
B drawn ids and their log-probs come back. On a GPU the draws use a device generator seeded by
one draw from the host `generator` (`device_generator`): reproducible per seed, not the CPU
run's tokens. `rollout.decoders.sampler_dtype=bf16` runs these forwards under bf16 autocast
(`rollout.precision`): a real sampler-trainer mismatch on one stack.
`rollout.decoders.router_noise_std` makes the sampler's routers pick their top-k from noisy router
logits (`moe.routing.noise`): an engine whose routing disagrees with the trainer's at a chosen rate, in
every forward the sampler runs (rollouts and evaluations, as an engine serves both). "fixed"
noise is one function of the router's input for the whole run (`noise_seed`); "fresh" noise is
drawn anew in each rollout, seeded by one draw from its generator (resumable: a function of the
rollout batch), and from `noise_seed` in evaluations, which pass no generator.

Every rank takes the same number of decode steps: sampling stops only when all ranks are done
(`dist.all_ranks`), finished rows meanwhile decode padding. A per-rank stop desynchronises the
EP all-to-all of the decode steps (docs/pitfalls.md#collectives).
"""

from __future__ import annotations

import copy
import time

import torch

from megatron_gspo.dist import all_ranks
from megatron_gspo.rollout.batch import left_pad
from megatron_gspo.rollout.precision import sampler_precision
from megatron_gspo.rollout.sampler import Samples, SamplingParams, prompt_ids
from moe.inference.decode import kv_decoder
from moe.routing.noise import router_noise


class DecoderSampler:
    """Samples with `moe.inference.decode`'s KV-cache decoder `kind` ("lean" or "megatron") over the
    policy's live weights (nothing to sync); the model runs in eval mode while it samples."""

    def __init__(self, policy, tokenizer, kind: str, kv_cache: bool = True,
                 sampler_dtype: str = "same", router_noise_std: float = 0.0,
                 router_noise: str = "fixed", noise_seed: int = 0):
        self.policy, self.kind, self.kv_cache, self.dtype = policy, kind, kv_cache, sampler_dtype
        self.noise_std, self.noise_seed = router_noise_std, noise_seed
        self.noise_fixed = router_noise == "fixed"
        self.pad_id = tokenizer.pad_id
        self.stop_ids = torch.tensor(sorted(tokenizer.stop_ids), dtype=torch.long)

    @torch.no_grad()
    def sample(self, prompts: list[list[int]], params: SamplingParams,
               generator: torch.Generator | None = None) -> Samples:
        """Collective: every rank calls it and decodes until all ranks' rows are done (or
        `max_new_tokens`), so T is the same step count on every rank."""
        model = self.policy.model
        was_training = model.training
        if was_training:
            self.policy.train(False)
        try:
            with sampler_precision(self.policy, self.dtype), \
                    router_noise(self.policy, self.noise_std, self._noise_generator(generator),
                                 fixed=self.noise_fixed):
                return self._sample(prompts, params, generator)
        finally:
            if was_training:
                self.policy.train(True)

    def beside(self, make_policy) -> "BesideDecoder":
        """This decoder over a weight copy of its own, for sampling beside the trainer
        (`rollout.max_staleness`): `make_policy()` builds the copy (no optimizer)."""
        return BesideDecoder(self, make_policy())

    def _noise_generator(self, generator: torch.Generator | None) -> torch.Generator | None:
        """The router noise's generator on the policy's device (None without noise): seeded
        by `noise_seed` for fixed noise and in evaluations, else by one draw from `generator`
        (a rollout's)."""
        if not self.noise_std:
            return None
        seed = self.noise_seed if generator is None or self.noise_fixed else \
            int(torch.randint(2 ** 63 - 1, (1,), generator=generator))
        return torch.Generator(self.policy.device).manual_seed(seed)

    def _sample(self, prompts, params: SamplingParams, generator) -> Samples:
        policy = self.policy
        tokens_BT, valid_BT = left_pad(prompts, self.pad_id)
        B = tokens_BT.shape[0]
        response_BT = torch.zeros_like(valid_BT)
        logp_BT = torch.zeros(tokens_BT.shape, dtype=torch.float32)
        done_B = torch.zeros(B, dtype=torch.bool)
        decoder = None
        if self.kv_cache or params.record_routing:
            decoder = kv_decoder(policy, self.kind, B, tokens_BT.shape[1] + params.max_new_tokens,
                                 params.record_routing)
        if params.record_routing and decoder is None:
            raise ValueError("recording rollout routing (R3) needs the KV-cache sampler, which "
                             "sequence parallelism does not support")
        draw_gen = generator
        for step in range(params.max_new_tokens):
            logits_BV = decoder.next_logits(tokens_BT, valid_BT) if decoder is not None \
                else policy.logits(tokens_BT, valid_BT)[:, -1]
            if step == 0 and not params.greedy:  # where the logits are: a device generator
                draw_gen = device_generator(generator, logits_BV.device)
            next_B, step_logp_B = (t.cpu() for t in draw(  # B values to the host, not B x V
                logits_BV, params, generator=draw_gen))
            live_B = ~done_B  # finished rows decode padding, log-prob 0
            next_B = torch.where(live_B, next_B, torch.full_like(next_B, self.pad_id))
            tokens_BT = torch.cat([tokens_BT, next_B[:, None]], dim=1)
            valid_BT = torch.cat([valid_BT, live_B[:, None]], dim=1)
            response_BT = torch.cat([response_BT, live_B[:, None]], dim=1)
            logp_BT = torch.cat([logp_BT, (step_logp_B * live_B)[:, None]], dim=1)
            done_B |= torch.isin(next_B, self.stop_ids)
            if all_ranks(bool(done_B.all())):  # never a per-rank break (docs/pitfalls.md#collectives)
                break
        routing = None
        if params.record_routing:
            decoder.next_logits(tokens_BT, valid_BT)  # route the last sampled column too
            routing = decoder.routing(valid_BT)
        return Samples(tokens_BT, valid_BT, response_BT, logp_BT, routing)


class BesideDecoder:
    """`rollout.overlap.Beside` for our decoders: the run's decoder settings over a policy of
    its own, sampled in the producer's thread while the trainer trains; `publish` copies the
    trainer's weights into it (one copy of the model, no optimizer state)."""

    def __init__(self, decoder: DecoderSampler, own_policy):
        self.source = decoder.policy
        self.sampler = copy.copy(decoder)
        self.sampler.policy = own_policy

    def publish(self) -> dict:
        t0 = time.perf_counter()
        copy_weights(self.source, self.sampler.policy)
        return {"time/weight_sync": time.perf_counter() - t0}

    def sample(self, prompts: list[list[int]], params: SamplingParams,
               generator: torch.Generator | None = None) -> Samples:
        return self.sampler.sample(prompts, params, generator)

    def recover(self, error: Exception) -> None:
        raise error  # nothing to restart: the decoder's own error

    def close(self) -> None:
        pass


@torch.no_grad()
def copy_weights(source, target) -> None:
    """`source`'s parameters and buffers into `target`, a policy of the same architecture and
    layout (by name: a name or shape that differs is an error)."""
    src, dst = source.model.module, target.model.module
    for get in ("named_parameters", "named_buffers"):
        theirs = dict(getattr(dst, get)())
        for name, tensor in getattr(src, get)():
            theirs.pop(name).copy_(tensor)
        if theirs:
            raise ValueError(f"copy_weights: {sorted(theirs)[:3]} only in the target")


def sample_prompts(policy, tokenizer, prompts: list[str], params: SamplingParams, *,
                   kind: str = "lean", kv_cache: bool = True,
                   generator: torch.Generator | None = None) -> Samples:
    """Sample responses to prompt texts with our decoder `kind` (tools such as `hf_parity`)."""
    return DecoderSampler(policy, tokenizer, kind, kv_cache).sample(
        prompt_ids(tokenizer, prompts), params, generator)


def top_p_filter(logits_BV: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask logits outside the smallest set whose probability reaches top_p (keeps >= 1)."""
    if top_p >= 1.0:
        return logits_BV
    sorted_BV, order_BV = logits_BV.sort(dim=-1, descending=True)
    cum_BV = sorted_BV.softmax(-1).cumsum(-1)
    drop_BV = cum_BV - sorted_BV.softmax(-1) >= top_p  # mass before this token already >= p
    drop_BV[:, 0] = False
    return logits_BV.masked_fill(drop_BV.scatter(1, order_BV, drop_BV), float("-inf"))


def device_generator(generator: torch.Generator | None,
                     device: torch.device) -> torch.Generator | None:
    """The generator for draws on `device` (with its index, as `logits.device` gives it):
    `generator` itself where it lives there (CPU runs: their streams unchanged), else a
    generator of that device seeded by one 63-bit draw from `generator` (None: torch's default
    generator of that device)."""
    if generator is None or generator.device == torch.device(device):
        return generator
    seed = int(torch.randint(2 ** 63 - 1, (1,), generator=generator))
    return torch.Generator(device).manual_seed(seed)


def draw(logits_BV: torch.Tensor, params: SamplingParams,
         generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sampling step on the logits' device: (next token ids [B], their log-probs under the
    temperature-scaled distribution, before top-p [B])."""
    logits_BV = logits_BV / params.temperature
    logp_BV = torch.log_softmax(logits_BV, dim=-1)
    if params.greedy:
        next_B = logits_BV.argmax(-1)
    else:
        probs_BV = top_p_filter(logits_BV, params.top_p).softmax(-1)
        next_B = torch.multinomial(probs_BV, 1, generator=generator).squeeze(1)
    return next_B, logp_BV.gather(1, next_B[:, None]).squeeze(1)


def _decoder_factory(kind: str):
    def factory(policy, tokenizer, cfg) -> DecoderSampler:
        return DecoderSampler(policy, tokenizer, kind, kv_cache=cfg.rollout.decoders.kv_cache,
                              sampler_dtype=cfg.rollout.decoders.sampler_dtype,
                              router_noise_std=cfg.rollout.decoders.router_noise_std,
                              router_noise=cfg.rollout.decoders.router_noise,
                              noise_seed=cfg.seed)
    return factory


def clean_decoder(policy, tokenizer, cfg) -> DecoderSampler:
    """The trainer's own decoder over `policy`, whatever the run's sampler: "lean", the
    policy's precision, clean routers (the KV cache unless sequence parallelism forbids it).
    What `megatron_gspo.run.setup.trainer_sampler` scores the test split with beside an engine
    or a mismatched decoder."""
    return DecoderSampler(policy, tokenizer, "lean", kv_cache=not cfg.model.sequence_parallel)


lean_sampler = _decoder_factory("lean")
"""Backend "lean"'s factory (registered in `megatron_gspo.rollout.backends`)."""
megatron_sampler = _decoder_factory("megatron")
"""Backend "megatron"'s factory (registered in `megatron_gspo.rollout.backends`)."""
