"""Rollouts and the greedy eval through a `Sampler`: prompts in, rewarded batches out.

Shape legend: B sequences (prompts x G, group-major), T tokens.

`generate_rollouts` encodes each example's prompt (the tokenizer's chat template and <bos>),
asks the sampler for G responses per prompt, decodes and scores them with the task's verifier
and returns a `RolloutBatch`. `evaluate` greedy-decodes held-out prompts with the same sampler
and scores them; `sampled_reward` samples one response per held-out prompt instead. Both are collective under data parallelism: every rank samples as many
batches (a rank with fewer examples samples filler), so the samplers' collectives line up.
"""

from __future__ import annotations

from typing import Callable

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
                      max_rows: int = 0, score: bool = True) -> RolloutBatch:
    """G samples for each example (group-major), decoded and rewarded by the task. `max_rows`
    (`rollout.max_batch_rows`, > 0): the sampler is called on consecutive blocks of whole
    groups of at most that many rows (one group at least), drawing from `generator` in turn,
    and the blocks are merged into one batch (`filters.concat_batches`): it bounds the
    sampler's KV cache. Every rank holds as many examples, so ranks make as many calls.
    `score=False`: rewards left at 0 for `score_rollouts` to fill (on the main thread, where
    a reward's time limit works)."""
    per = max(1, max_rows // group_size) if max_rows else max(1, len(examples))
    parts = [_generate(sampler, tokenizer, task, examples[i:i + per], group_size, params,
                       generator, score) for i in range(0, len(examples), per)]
    return parts[0] if len(parts) == 1 else concat_batches(parts, tokenizer.pad_id)


def _generate(sampler: Sampler, tokenizer, task, examples: list, group_size: int,
              params: SamplingParams, generator: torch.Generator | None,
              score: bool) -> RolloutBatch:
    """One sampler call: G samples for each example."""
    repeated = [ex for ex in examples for _ in range(group_size)]
    s = sampler.sample(prompt_ids(tokenizer, [ex.prompt for ex in repeated]), params, generator)
    completions = decode_responses(tokenizer, s.tokens_BT, s.response_BT)
    group_B = torch.arange(len(examples)).repeat_interleave(group_size)
    batch = RolloutBatch(s.tokens_BT, s.valid_BT, s.response_BT, s.logp_BT,
                         torch.zeros(len(repeated)), group_B, completions, repeated, s.routing,
                         truncated_rows(s.tokens_BT, s.response_BT, tokenizer.stop_ids),
                         torch.zeros(len(repeated), dtype=torch.int8))
    if score:
        score_rollouts(batch, task)
    return batch


def score_rollouts(batch: RolloutBatch, task) -> None:
    """The task's reward of each row's completion (`tasks.rewards.compute_rewards`), into
    `rewards_B` and `reward_status_B`."""
    rewards, status = compute_rewards(task, batch.examples, batch.completions)
    batch.rewards_B = torch.tensor(rewards, dtype=torch.float32)
    batch.reward_status_B = torch.tensor(status, dtype=torch.int8)


def truncated_rows(tokens_BT: torch.Tensor, response_BT: torch.Tensor, stop_ids) -> torch.Tensor:
    """[B] bool: the row's last response token is not a stop id (it ran out of tokens)."""
    T = tokens_BT.shape[1]
    last_B = (response_BT.long() * torch.arange(T)).argmax(1)
    last_tok_B = tokens_BT.gather(1, last_B[:, None]).squeeze(1)
    stops = torch.tensor(sorted(stop_ids), dtype=tokens_BT.dtype)
    return ~torch.isin(last_tok_B, stops) & response_BT.any(1)


Progress = Callable[[int, int, int], None]
"""Called with (0, chunks, 0) before an eval's first chunk and (k, chunks, response tokens of
chunk k) after chunk k, on every rank (`megatron_gspo.run.progress.ChunkProgress`)."""


def evaluate(sampler: Sampler, tokenizer, task, examples: list, *, max_new_tokens: int,
             batch_size: int = 128, progress: Progress | None = None) -> dict[str, float]:
    """Greedy-decode accuracy on held-out examples (`eval/...` metrics from `task` scoring).

    Collective: every rank runs the largest chunk count of any rank; a rank with fewer chunks
    decodes its first example as filler and discards it (docs/pitfalls.md#collectives)."""
    if not examples:
        raise ValueError("evaluate: no examples")
    params = SamplingParams(max_new_tokens=max_new_tokens, greedy=True)
    completions = []
    n_chunks = max_over_ranks(-(-len(examples) // batch_size))
    if progress:
        progress(0, n_chunks, 0)
    for k, start in enumerate(range(0, n_chunks * batch_size, batch_size), 1):
        chunk = examples[start:start + batch_size] or examples[:1]  # filler past this rank's end
        s = sampler.sample(prompt_ids(tokenizer, [ex.prompt for ex in chunk]), params)
        completions += decode_responses(tokenizer, s.tokens_BT, s.response_BT)
        if progress:
            progress(k, n_chunks, int(s.response_BT.sum()))
    return score(task, examples, completions[:len(examples)])


def sampled_reward(sampler: Sampler, tokenizer, task, examples: list, params: SamplingParams,
                   generator: torch.Generator, batch_size: int = 128,
                   progress: Progress | None = None) -> float:
    """The mean reward of one response per example sampled with `params` from `generator`
    (the test split's `test/reward`). Collective like `evaluate`."""
    if not examples:
        raise ValueError("sampled_reward: no examples")
    rewards = []
    n_chunks = max_over_ranks(-(-len(examples) // batch_size))
    if progress:
        progress(0, n_chunks, 0)
    for k, start in enumerate(range(0, n_chunks * batch_size, batch_size), 1):
        chunk = examples[start:start + batch_size] or examples[:1]  # filler past this rank's end
        s = sampler.sample(prompt_ids(tokenizer, [ex.prompt for ex in chunk]), params, generator)
        rewards += compute_rewards(task, chunk, decode_responses(tokenizer, s.tokens_BT,
                                                                 s.response_BT))[0]
        if progress:
            progress(k, n_chunks, int(s.response_BT.sum()))
    return sum(rewards[:len(examples)]) / len(examples)
