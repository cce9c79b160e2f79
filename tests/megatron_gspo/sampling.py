"""Test helpers over the decoder sampler with the keyword interface the tests were written
against: text prompts in, the (tokens, valid, response, log-probs, routing) tuple out."""

import torch

from megatron_gspo.rollout import decoders
from megatron_gspo.rollout.batch import left_pad
from megatron_gspo.rollout.sampler import SamplingParams, prompt_ids


def encode_prompts(tokenizer, prompts):
    """Left-padded `<bos> prompt` ids [B, P] and their valid mask."""
    return left_pad(prompt_ids(tokenizer, prompts), tokenizer.pad_id)


def sample(policy, tokenizer, prompts, *, max_new_tokens, temperature=1.0, top_p=1.0,
           greedy=False, generator=None, kv_cache=True, record_routing=False, kind="lean"):
    s = decoders.DecoderSampler(policy, tokenizer, kind, kv_cache).sample(
        prompt_ids(tokenizer, prompts),
        SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                       greedy=greedy, record_routing=record_routing), generator)
    return s.tokens_BT, s.valid_BT, s.response_BT, s.logp_BT, s.routing


def draw(logits_BV, *, temperature, top_p, greedy, generator):
    return decoders.draw(logits_BV, SamplingParams(max_new_tokens=1, temperature=temperature,
                                                   top_p=top_p, greedy=greedy), generator)


def decoder_sampler(policy, tokenizer, kind="lean", kv_cache=True):
    return decoders.DecoderSampler(policy, tokenizer, kind, kv_cache)


def rollout_params(max_new_tokens, temperature=1.0, top_p=1.0, record_routing=False):
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                          record_routing=record_routing)


__all__ = ["encode_prompts", "sample", "draw", "decoder_sampler", "rollout_params", "torch"]
