"""Rollouts: sample G responses per prompt from the policy and score them.

Shape legend: B sequences (prompts x G, group-major), P prompt tokens, T total tokens.

Sequences are laid out as [left padding][<bos> prompt][response ... <eos>][right padding]; every
row's prompt ends in the same column, so each sampling step appends one column to all rows.
`valid_BT` marks real tokens, `response_BT` the response tokens (including <eos>) that carry
the policy loss.

Sampling uses a KV cache (`MoEPolicy.kv_decoder`: `moe.decode.LeanKVDecoder` by default,
megatron-core's static inference path with `rollout.decoder=megatron`): the prompt columns are
prefilled once, then each step runs the model on one new column. With `kv_cache=False`, or under
sequence parallelism (which megatron-core requires for MoE with TP > 1), each step recomputes the
full forward instead (same logits up to float rounding). With `record_routing` (R3) the decoder
also records every MoE layer's top-k ids as it goes, plus one last decode step for the final
sampled column, giving `RolloutBatch.routing`: the routing the sampler itself used.
Each step's temperature, log-softmax, top-p and draw run where the logits are (on a GPU: no
[B, V] copy to the host per token, 39 MB at B=64 and Qwen3's 151,936-token vocabulary); only the
B drawn ids and their log-probs come back. On a GPU the draws use a device generator seeded by
one draw from the host `generator` (`device_generator`): reproducible per seed, not the CPU
run's tokens (its logits differ anyway). On CPU nothing changes: the same ops, same stream.
`sampler_logp_BT` is log pi(y_t) under the temperature-scaled distribution the tokens were drawn
from (before top-p filtering, as vLLM reports it), so it is directly comparable with the trainer's
recompute and usable as pi_old (`rollout.use_sampler_logprobs`, the GSPO paper's claim that
inference-engine likelihoods suffice for sequence-level ratios).

Every rank takes the same number of decode steps (and `evaluate` the same number of chunks):
sampling stops only when all ranks are done (`dist_utils.all_ranks`), finished rows meanwhile
decode padding. A per-rank stop desynchronises the EP all-to-all of the decode steps
(PITFALLS #13).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from megatron_gspo.dist import all_ranks, max_over_ranks
from megatron_gspo.tasks.rewards import compute_rewards


@dataclass
class RolloutBatch:
    """One rollout batch; `select(rows)` gives a minibatch."""

    tokens_BT: torch.Tensor
    valid_BT: torch.Tensor
    response_BT: torch.Tensor
    sampler_logp_BT: torch.Tensor
    rewards_B: torch.Tensor
    group_B: torch.Tensor
    """Index of the prompt each row answers (rows of a group are contiguous)."""
    completions: list
    examples: list
    routing: object = None
    """Rollout-time routing (`moe.replay.RoutingReplayCache`) when recorded for R3, else None."""
    truncated_B: torch.Tensor | None = None
    """True where the response hit max_new_tokens without a stop token."""
    reward_status_B: torch.Tensor | None = None
    """`rewards.compute_rewards` status per row: 0 ok, 1 the reward raised, 2 it timed out."""

    def __len__(self) -> int:
        return self.tokens_BT.shape[0]

    def select(self, rows: torch.Tensor) -> "RolloutBatch":
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if torch.is_tensor(value):
                out[f.name] = value[rows]
            elif isinstance(value, list):
                out[f.name] = [value[i] for i in rows.tolist()]
            else:  # the routing cache, or None
                out[f.name] = None if value is None else value.select(rows)
        return RolloutBatch(**out)

    @property
    def response_lengths_B(self) -> torch.Tensor:
        return self.response_BT.sum(1)

    @property
    def response_start(self) -> int:
        """The first column holding a response token of any row (>= 1): where log-probs must
        begin. One sampling round left-pads its prompts, so its responses share this column;
        dynamic sampling's concatenated rounds may start later in some rows, which then get
        (unused) log-probs of a few prompt columns too."""
        cols = self.response_BT.any(0).nonzero()
        return max(1, int(cols[0])) if len(cols) else 1


def encode_prompts(tokenizer, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded `<bos> prompt` token ids [B, P] (no <bos> when the tokenizer has none) and
    their valid mask."""
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    ids = [bos + tokenizer.encode(p) for p in prompts]
    P = max(len(x) for x in ids)
    tokens_BP = torch.full((len(ids), P), tokenizer.pad_id, dtype=torch.long)
    valid_BP = torch.zeros(len(ids), P, dtype=torch.bool)
    for b, x in enumerate(ids):
        tokens_BP[b, P - len(x):] = torch.tensor(x)
        valid_BP[b, P - len(x):] = True
    return tokens_BP, valid_BP


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


@torch.no_grad()
def sample(policy, tokenizer, prompts: list[str], *, max_new_tokens: int,
           temperature: float = 1.0, top_p: float = 1.0, greedy: bool = False,
           generator: torch.Generator | None = None, kv_cache: bool = True,
           record_routing: bool = False):
    """Sample responses: (tokens_BT, valid_BT, response_BT, sampler_logp_BT) on CPU, and the
    rollout-time routing cache (None unless `record_routing`, which needs the KV cache).

    Collective: every rank calls it and decodes until all ranks' rows are done (or
    `max_new_tokens`), so T is the same step count on every rank."""
    tokens_BT, valid_BT = encode_prompts(tokenizer, prompts)
    B = tokens_BT.shape[0]
    response_BT = torch.zeros_like(valid_BT)
    logp_BT = torch.zeros(tokens_BT.shape, dtype=torch.float32)
    done_B = torch.zeros(B, dtype=torch.bool)
    stop_ids = torch.tensor(sorted(tokenizer.stop_ids), dtype=torch.long)
    decoder = policy.kv_decoder(B, tokens_BT.shape[1] + max_new_tokens, record_routing) \
        if kv_cache or record_routing else None
    if record_routing and decoder is None:
        raise ValueError("recording rollout routing (R3) needs the KV-cache sampler, which "
                         "sequence parallelism does not support")
    draw_gen = generator
    for step in range(max_new_tokens):
        logits_BV = decoder.next_logits(tokens_BT, valid_BT) if decoder is not None \
            else policy.logits(tokens_BT, valid_BT)[:, -1]
        if step == 0 and not greedy:  # where the logits are: a device generator on a GPU
            draw_gen = device_generator(generator, logits_BV.device)
        next_B, step_logp_B = (t.cpu() for t in draw(  # B values to the host, not B x V
            logits_BV, temperature=temperature, top_p=top_p, greedy=greedy, generator=draw_gen))
        live_B = ~done_B  # finished rows decode padding, log-prob 0
        next_B = torch.where(live_B, next_B, torch.full_like(next_B, tokenizer.pad_id))
        step_logp_B = step_logp_B * live_B
        tokens_BT = torch.cat([tokens_BT, next_B[:, None]], dim=1)
        valid_BT = torch.cat([valid_BT, live_B[:, None]], dim=1)
        response_BT = torch.cat([response_BT, live_B[:, None]], dim=1)
        logp_BT = torch.cat([logp_BT, step_logp_B[:, None]], dim=1)
        done_B |= torch.isin(next_B, stop_ids)
        if all_ranks(bool(done_B.all())):  # never a per-rank break (PITFALLS #13)
            break
    routing = None
    if record_routing:
        decoder.next_logits(tokens_BT, valid_BT)  # route the last sampled column too
        routing = decoder.routing(valid_BT)
    return tokens_BT, valid_BT, response_BT, logp_BT, routing


def draw(logits_BV: torch.Tensor, *, temperature: float, top_p: float, greedy: bool,
         generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sampling step on the logits' device: (next token ids [B], their log-probs under the
    temperature-scaled distribution, before top-p [B])."""
    logits_BV = logits_BV / temperature
    logp_BV = torch.log_softmax(logits_BV, dim=-1)
    if greedy:
        next_B = logits_BV.argmax(-1)
    else:
        probs_BV = top_p_filter(logits_BV, top_p).softmax(-1)
        next_B = torch.multinomial(probs_BV, 1, generator=generator).squeeze(1)
    return next_B, logp_BV.gather(1, next_B[:, None]).squeeze(1)


def decode_responses(tokenizer, tokens_BT: torch.Tensor, response_BT: torch.Tensor) -> list[str]:
    return [tokenizer.decode(row[mask].tolist()) for row, mask in zip(tokens_BT, response_BT)]


def generate_rollouts(policy, tokenizer, task, examples: list, *, group_size: int,
                      max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                      generator: torch.Generator | None = None, kv_cache: bool = True,
                      record_routing: bool = False) -> RolloutBatch:
    """G samples for each example (group-major), decoded and rewarded by the task."""
    repeated = [ex for ex in examples for _ in range(group_size)]
    tokens_BT, valid_BT, response_BT, logp_BT, routing = sample(
        policy, tokenizer, [ex.prompt for ex in repeated], max_new_tokens=max_new_tokens,
        temperature=temperature, top_p=top_p, generator=generator, kv_cache=kv_cache,
        record_routing=record_routing)
    completions = decode_responses(tokenizer, tokens_BT, response_BT)
    rewards, status = compute_rewards(task, repeated, completions)
    rewards_B = torch.tensor(rewards, dtype=torch.float32)
    group_B = torch.arange(len(examples)).repeat_interleave(group_size)
    return RolloutBatch(tokens_BT, valid_BT, response_BT, logp_BT, rewards_B, group_B,
                        completions, repeated, routing,
                        truncated_rows(tokens_BT, response_BT, tokenizer.stop_ids),
                        torch.tensor(status, dtype=torch.int8))


def truncated_rows(tokens_BT: torch.Tensor, response_BT: torch.Tensor, stop_ids) -> torch.Tensor:
    """[B] bool: the row's last response token is not a stop id (it ran out of tokens)."""
    T = tokens_BT.shape[1]
    last_B = (response_BT.long() * torch.arange(T)).argmax(1)
    last_tok_B = tokens_BT.gather(1, last_B[:, None]).squeeze(1)
    stops = torch.tensor(sorted(stop_ids), dtype=tokens_BT.dtype)
    return ~torch.isin(last_tok_B, stops) & response_BT.any(1)


def evaluate(policy, tokenizer, task, examples: list, *, max_new_tokens: int,
             batch_size: int = 128, kv_cache: bool = True) -> dict[str, float]:
    """Greedy-decode accuracy on held-out examples (`eval/...` metrics from `task` scoring).

    Collective: every rank runs the largest chunk count of any rank; a rank with fewer chunks
    decodes its first example as filler and discards it (PITFALLS #13)."""
    from megatron_gspo.tasks.toy import score

    if not examples:
        raise ValueError("evaluate: no examples")
    was_training = policy.model.training
    policy.train(False)
    completions = []
    n_chunks = max_over_ranks(-(-len(examples) // batch_size))
    for start in range(0, n_chunks * batch_size, batch_size):
        chunk = examples[start:start + batch_size] or examples[:1]  # filler past this rank's end
        tokens_BT, _, response_BT, _, _ = sample(policy, tokenizer, [ex.prompt for ex in chunk],
                                              max_new_tokens=max_new_tokens, greedy=True,
                                              kv_cache=kv_cache)
        completions += decode_responses(tokenizer, tokens_BT, response_BT)
    policy.train(was_training)
    return score(task, examples, completions[:len(examples)])
