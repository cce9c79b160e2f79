"""Rollouts from megatron-core's dynamic inference engine over the policy's own GPTModel.

Shape legend: B sequences, T columns, P prompt columns, L MoE layers, K top-k, N valid tokens.

megatron-core 0.19's `DynamicInferenceEngine` (what Megatron-LM's own RL samples with) runs the
same `GPTModel` the trainer updates: no weight copy and no weight sync. It keeps keys and values
in a paged cache, batches requests in flight, can replay its decode steps as CUDA graphs, and
with `moe_enable_routing_replay` records every MoE layer's top-k per token
(`inference/contexts/routing_metadata.py`): the routing R3 replays (arXiv 2510.11370).

`EngineSampler.generate` takes prompt ids and returns, per request, the new tokens, their
log-probs under the sampling distribution and the routing of every token but the last (that one
never ran through the model); `to_batch` lays them out as the trainer's rollout batch (prompts
left-padded to one column, responses after it) with a `moe.routing.replay.RoutingReplayCache`. The last
token's routing is filler (experts 0..K-1): its hidden state predicts nothing the loss reads.

Departures from megatron's engine defaults: log-probs of the distribution the token was drawn
from (megatron's "processed" mode: after temperature and filtering); without flash-attn (no
wheel installs beside a CUDA 13 torch here) attention runs through `moe.inference.paged_attention`;
vocabulary padding beyond the tokenizer's is masked in the output layer; one `termination_id`
stops a request in the engine, further stop ids are cut afterwards (`cut_at_stop`). CUDA only: on CPU, or with a megatron-core older than 0.19,
`unavailable()` says why in one line.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import megatron.core
import numpy as np
import torch
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.transformer.moe.router_replay import RouterReplay

from moe.inference import paged_attention
from moe.routing.replay import RoutingReplayCache, ids_dtype

try:  # the dynamic engine's API of megatron-core >= 0.19; older: `unavailable()` says so
    from megatron.core.inference.config import InferenceConfig
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
        GPTInferenceWrapper)
    from megatron.core.inference.text_generation_controllers.text_generation_controller \
        import TextGenerationController
    from megatron.core.inference.utils import InferenceMode
except ImportError as e:
    _IMPORT_ERROR: ImportError | None = e
else:
    _IMPORT_ERROR = None

MIN_MEGATRON_CORE = (0, 19)


def unavailable() -> str | None:
    """Why the engine cannot run here (one line), or None."""
    if not torch.cuda.is_available():
        return "rollout.backend=megatron_engine needs a CUDA GPU (megatron-core's dynamic " \
               "inference engine runs on CUDA only); use rollout.backend=lean on CPU"
    version = tuple(int(p) for p in megatron.core.__version__.split(".")[:2])
    if version < MIN_MEGATRON_CORE:
        return f"rollout.backend=megatron_engine needs megatron-core >= 0.19 (installed: " \
               f"{megatron.core.__version__}; it needs Python >= 3.12)"
    if _IMPORT_ERROR is not None:
        return f"rollout.backend=megatron_engine: megatron-core {megatron.core.__version__}'s " \
               f"dynamic inference engine does not import ({_IMPORT_ERROR})"
    return None


@dataclass
class EngineRequest:
    """One finished request: prompt ids, new ids, their log-probs, routing [P + R - 1, L, K]."""

    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    routing: np.ndarray | None


class _Tokenizer:
    """What the engine asks of a tokenizer when prompts come as ids: an end id and a
    detokenizer (its text is not used)."""

    def __init__(self, eod: int):
        self.eod, self.bos = eod, None

    def detokenize(self, tokens, **kwargs) -> str:
        return ""

    def tokenize(self, text):
        raise TypeError("EngineSampler takes token ids, not text")


class EngineSampler:
    """megatron-core's dynamic engine over `policy`'s GPTModel (see the module docstring).

    `cuda_graphs`: capture decode steps as CUDA graphs (the model must have been built with
    `cuda_graph_impl='local'` and block scope: `moe.model.gpt.build_gpt_moe(inference_graphs=True)`).
    """

    def __init__(self, policy, *, max_requests: int, max_seq_len: int, max_tokens: int = 8192,
                 buffer_size_gb: float = 4.0, block_size: int = 256, cuda_graphs: bool = False,
                 eod: int = -1):
        why = unavailable()
        if why:
            raise RuntimeError(why)
        gpt = policy.model.module if hasattr(policy.model, "module") else policy.model
        problems = paged_attention.check(gpt.config)
        if problems:
            raise ValueError(f"rollout.backend=megatron_engine does not support {problems}")
        if cuda_graphs and gpt.config.params_dtype == torch.float32:
            raise ValueError("rollout.megatron_engine.cuda_graphs=true needs a 16-bit model "
                             "(model.dtype=bf16): torch's float32 grouped GEMM reads the "
                             "experts' offsets on the host, which a CUDA graph cannot capture; "
                             "or rollout.megatron_engine.cuda_graphs=false")
        self.policy, self.gpt = policy, gpt
        paged_attention.install(gpt)
        config = InferenceConfig(
            block_size_tokens=block_size, buffer_size_gb=buffer_size_gb,
            max_requests=max_requests, max_tokens=max_tokens, max_sequence_length=max_seq_len,
            num_cuda_graphs=16 if cuda_graphs else None,
            use_cuda_graphs_for_non_decode_steps=False, materialize_only_last_token_logits=True,
            logprobs_mode="processed_logprobs")
        gpt.eval()
        with paged_attention.flash_check_waived(), self._padding_vocab_masked():
            self.context = DynamicInferenceContext(gpt.config, config)
            wrapper = GPTInferenceWrapper(gpt, self.context)
            controller = TextGenerationController(inference_wrapped_model=wrapper,
                                                  tokenizer=_Tokenizer(eod))
            self.engine = DynamicInferenceEngine(controller=controller, context=self.context)
        # The engine marks the process as inferring from its construction on (megatron's
        # `InferenceMode`, which makes GPTModel.forward take its inference path); here it is
        # active only inside `generate`, so the trainer's forwards stay training forwards.
        InferenceMode.unset_active()

    @contextlib.contextmanager
    def _padding_vocab_masked(self):
        """Within (the engine's forwards, and its CUDA graphs' capture): -inf on the preset's
        padding logits (ids >= the tokenizer's vocabulary). The trainer's forwards mask them
        themselves (`MoEPolicy.mask_vocab`)."""
        real, layer = self.policy.real_vocab, self.gpt.output_layer
        if real >= self.policy.preset.vocab_size:
            yield
            return

        def hook(module, args, output):
            logits = output[0] if isinstance(output, tuple) else output
            logits[..., real:] = float("-inf")
            return output

        handle = layer.register_forward_hook(hook)
        try:
            yield
        finally:
            handle.remove()

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], *, max_new_tokens: int,
                 temperature: float = 1.0, top_p: float = 0.0, top_k: int = 0,
                 termination_id: int = -1) -> list[EngineRequest]:
        """Sample one response per prompt (repeat a prompt for a group); input order kept.
        `top_p` 0 and `top_k` 0 filter nothing (megatron's sentinels); the log-probs are those
        of the distribution drawn from (after temperature and filtering: megatron's
        "processed" log-probs); `termination_id` -1 never stops early."""
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                                return_log_probs=True, skip_prompt_log_probs=True,
                                num_tokens_to_generate=max_new_tokens,
                                termination_id=termination_id)
        was_training = self.gpt.training
        self.gpt.eval()
        try:
            with paged_attention.flash_check_waived(), InferenceMode.active(), \
                    self._padding_vocab_masked():
                records = self.engine.generate([list(p) for p in prompts], params)
        finally:  # graphed steps leave megatron's static routing buffers installed
            RouterReplay.clear_global_static_buffers()
            RouterReplay.clear_global_router_replay_action()
            for r in RouterReplay.global_router_replay_instances:
                r.clear_indices()
            self.gpt.train(was_training)
        out = []
        for prompt, record in zip(prompts, records):
            req = record.merge()
            routing = None if req.routing_indices is None else np.asarray(req.routing_indices)
            out.append(EngineRequest(list(prompt), [int(t) for t in req.generated_tokens],
                                     [float(x) for x in req.generated_log_probs or []], routing))
        return out


def cut_at_stop(req: EngineRequest, stop_ids) -> EngineRequest:
    """`req` ending at its first stop id (kept), if any."""
    stops = set(stop_ids)
    for i, t in enumerate(req.tokens):
        if t in stops:
            keep = i + 1
            routing = None if req.routing is None else req.routing[:len(req.prompt) + keep - 1]
            return EngineRequest(req.prompt, req.tokens[:keep], req.logprobs[:keep], routing)
    return req


def to_batch(requests: list[EngineRequest], pad_id: int, num_experts: int):
    """The trainer's layout of finished requests: (tokens_BT, valid_BT, response_BT,
    sampler_logp_BT, routing cache or None). Prompts end in one column (left padding),
    responses follow (right padding); the routing cache holds every valid token's top-k, the
    last token of each row filler (experts 0..K-1)."""
    P = max(len(r.prompt) for r in requests)
    T = P + max(len(r.tokens) for r in requests)
    B = len(requests)
    tokens_BT = torch.full((B, T), pad_id, dtype=torch.long)
    valid_BT = torch.zeros(B, T, dtype=torch.bool)
    response_BT = torch.zeros(B, T, dtype=torch.bool)
    logp_BT = torch.zeros(B, T)
    for b, r in enumerate(requests):
        start, end = P - len(r.prompt), P + len(r.tokens)
        tokens_BT[b, start:end] = torch.tensor(r.prompt + r.tokens)
        valid_BT[b, start:end] = True
        response_BT[b, P:end] = True
        logp_BT[b, P:end] = torch.tensor(r.logprobs, dtype=torch.float32)
    if any(r.routing is None for r in requests):
        return tokens_BT, valid_BT, response_BT, logp_BT, None
    rows = []
    for r in requests:
        n = len(r.prompt) + len(r.tokens)
        ids = torch.as_tensor(r.routing[:n - 1]).long()
        if ids.shape[0] != n - 1:
            raise ValueError(f"engine routing has {ids.shape[0]} tokens, expected {n - 1}")
        filler = torch.arange(ids.shape[2]).expand(1, ids.shape[1], -1)
        rows.append(torch.cat([ids, filler]))
    ids_NLK = torch.cat(rows).to(ids_dtype(num_experts))
    return tokens_BT, valid_BT, response_BT, logp_BT, RoutingReplayCache(ids_NLK, valid_BT,
                                                                         num_experts)


def routing_mismatch(engine_NLK: torch.Tensor, trainer_NLK: torch.Tensor) -> dict:
    """Per layer, how often the engine's and the trainer's top-k disagree on the same tokens:
    `set` the fraction of tokens whose top-k sets differ, `expert` the fraction of the K
    (token, expert) activations of the trainer that the engine did not activate."""
    N, L, K = trainer_NLK.shape
    E = int(max(engine_NLK.max(), trainer_NLK.max())) + 1
    eng = torch.zeros(N, L, E, dtype=torch.bool).scatter_(2, engine_NLK.long(), True)
    tr = torch.zeros(N, L, E, dtype=torch.bool).scatter_(2, trainer_NLK.long(), True)
    missing_NL = (tr & ~eng).sum(-1).float()
    return {"set": (missing_NL > 0).float().mean(0).tolist(),
            "expert": (missing_NL / K).mean(0).tolist(),
            "any_layer": float((missing_NL > 0).any(1).float().mean())}
