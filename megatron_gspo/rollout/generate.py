"""Rollouts and the greedy eval through a `Sampler`: prompts in, rewarded batches out.

Shape legend: B sequences (prompts x G, group-major), T tokens.

`generate_rollouts` encodes each example's prompt (the tokenizer's chat template and <bos>),
asks the sampler for G responses per prompt, decodes and scores them with the task's verifier
and returns a `RolloutBatch`. `evaluate` greedy-decodes held-out prompts with the same sampler
and scores them; `sampled_reward` samples one response per held-out prompt instead. Both are collective under data parallelism: every rank samples as many
batches (a rank with fewer examples samples filler), so the samplers' collectives line up.
"""

from __future__ import annotations

import torch

from megatron_gspo.dist import max_over_ranks
from megatron_gspo.rollout.batch import RolloutBatch
from megatron_gspo.rollout.filters import concat_batches
from megatron_gspo.rollout.sampler import Sampler, SamplingParams, prompt_ids
from megatron_gspo.tasks.rewards import compute_rewards
from megatron_gspo.tasks.toy import score


def decode_responses(tokenizer, tokens_BT: torch.Tensor, response_BT: torch.Tensor) -> list[str]:
    return [tokenizer.decode(row[mask].tolist()) for row, mask in zip(tokens_BT, response_BT)]


def generate_rollouts(sampler: Sampler, tokenizer, task, examples: list, *, group_size: int,
                      params: SamplingParams, generator: torch.Generator | None = None,
                      max_rows: int = 0) -> RolloutBatch:
    """G samples for each example (group-major), decoded and rewarded by the task. `max_rows`
    (`rollout.max_batch_rows`, > 0): the sampler is called on consecutive blocks of whole
    groups of at most that many rows (one group at least), drawing from `generator` in turn,
    and the blocks are merged into one batch (`filters.concat_batches`): it bounds the
    sampler's KV cache. Every rank holds as many examples, so ranks make as many calls."""
    per = max(1, max_rows // group_size) if max_rows else max(1, len(examples))
    parts = [_generate(sampler, tokenizer, task, examples[i:i + per], group_size, params,
                       generator) for i in range(0, len(examples), per)]
    return parts[0] if len(parts) == 1 else concat_batches(parts, tokenizer.pad_id)


def _generate(sampler: Sampler, tokenizer, task, examples: list, group_size: int,
              params: SamplingParams, generator: torch.Generator | None) -> RolloutBatch:
    """One sampler call: G samples for each example."""
    repeated = [ex for ex in examples for _ in range(group_size)]
    s = sampler.sample(prompt_ids(tokenizer, [ex.prompt for ex in repeated]), params, generator)
    completions = decode_responses(tokenizer, s.tokens_BT, s.response_BT)
    rewards, status = compute_rewards(task, repeated, completions)
    rewards_B = torch.tensor(rewards, dtype=torch.float32)
    group_B = torch.arange(len(examples)).repeat_interleave(group_size)
    return RolloutBatch(s.tokens_BT, s.valid_BT, s.response_BT, s.logp_BT, rewards_B, group_B,
                        completions, repeated, s.routing,
                        truncated_rows(s.tokens_BT, s.response_BT, tokenizer.stop_ids),
                        torch.tensor(status, dtype=torch.int8))


def truncated_rows(tokens_BT: torch.Tensor, response_BT: torch.Tensor, stop_ids) -> torch.Tensor:
    """[B] bool: the row's last response token is not a stop id (it ran out of tokens)."""
    T = tokens_BT.shape[1]
    last_B = (response_BT.long() * torch.arange(T)).argmax(1)
    last_tok_B = tokens_BT.gather(1, last_B[:, None]).squeeze(1)
    stops = torch.tensor(sorted(stop_ids), dtype=tokens_BT.dtype)
    return ~torch.isin(last_tok_B, stops) & response_BT.any(1)


def evaluate(sampler: Sampler, tokenizer, task, examples: list, *, max_new_tokens: int,
             batch_size: int = 128) -> dict[str, float]:
    """Greedy-decode accuracy on held-out examples (`eval/...` metrics from `task` scoring).

    Collective: every rank runs the largest chunk count of any rank; a rank with fewer chunks
    decodes its first example as filler and discards it (docs/pitfalls.md#collectives)."""
    if not examples:
        raise ValueError("evaluate: no examples")
    params = SamplingParams(max_new_tokens=max_new_tokens, greedy=True)
    completions = []
    n_chunks = max_over_ranks(-(-len(examples) // batch_size))
    for start in range(0, n_chunks * batch_size, batch_size):
        chunk = examples[start:start + batch_size] or examples[:1]  # filler past this rank's end
        s = sampler.sample(prompt_ids(tokenizer, [ex.prompt for ex in chunk]), params)
        completions += decode_responses(tokenizer, s.tokens_BT, s.response_BT)
    return score(task, examples, completions[:len(examples)])


def sampled_reward(sampler: Sampler, tokenizer, task, examples: list, params: SamplingParams,
                   generator: torch.Generator, batch_size: int = 128) -> float:
    """The mean reward of one response per example sampled with `params` from `generator`
    (the test split's `test/reward`). Collective like `evaluate`."""
    if not examples:
        raise ValueError("sampled_reward: no examples")
    rewards = []
    n_chunks = max_over_ranks(-(-len(examples) // batch_size))
    for start in range(0, n_chunks * batch_size, batch_size):
        chunk = examples[start:start + batch_size] or examples[:1]  # filler past this rank's end
        s = sampler.sample(prompt_ids(tokenizer, [ex.prompt for ex in chunk]), params, generator)
        rewards += compute_rewards(task, chunk, decode_responses(tokenizer, s.tokens_BT,
                                                                 s.response_BT))[0]
    return sum(rewards[:len(examples)]) / len(examples)
