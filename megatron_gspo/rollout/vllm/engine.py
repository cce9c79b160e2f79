"""Rollouts from vLLM running in this process: sampling, log-probs, routing, weight pushes.

Shape legend: P prompt tokens, R sampled tokens, L MoE layers, K experts per token (top-k),
E experts, N tokens in one engine step (all requests of the step, flattened).

`VLLMEngine(hf_dir, ...)` wraps an in-process `vllm.LLM` built from a Hugging Face folder.
`generate` returns, per (prompt, sample), the sampled ids, the engine's log-prob of each sampled
token and, with `capture_routing`, the routing of every token but the last as expert ids
[P + R - 1, L, K] (uint8 for E <= 256, else int16): the last sampled token never runs through
the model, so it has no routing (the layout `moe.inference.engine.to_batch` pads with filler).
`push_weights` takes new weights by Hugging Face name, streamed; `logprobs_of` scores a fixed
sequence (prompt log-probs at temperature 1), for a guard against stale weights.

Where this departs from vLLM's defaults, and why:
- In-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set here): weights are pushed as
  tensors and the routing hooks run inside the model, both without crossing a process.
- KV cache size explicit (`kv_cache_gb` -> `kv_cache_memory_bytes`): on CPU vLLM otherwise
  reserves a fraction of the host's memory (14.6 GiB measured) and starts slower.
- Log-probs: vLLM's default `raw_logprobs` are taken before temperature (`v1/sample/sampler.py`),
  `processed_logprobs` after the top-k / top-p mask (the renormalised nucleus). Ours are under
  the temperature-scaled distribution before top-p (`megatron_gspo.rollout.decoders.draw`): the engine
  runs `processed_logprobs` with the sampler's top-k/top-p step wrapped to return the
  log-softmax of the (temperature-divided) logits it receives. Equal where top_p = 1.
- Stop tokens: only `stop_ids` stop a sample (`ignore_eos=True`); the stop token is kept.
- `capture_routing`: prefix caching off (a cached prompt block is never run again, so its
  routing would be missing) and eager mode (`enforce_eager=True`): vLLM compiles the model
  without guards, so hooks installed after start-up are silently skipped in a compiled model.

Routing capture: `megatron_gspo.rollout.vllm.capture`.

Weight push on CPU (vLLM 0.32.0): `reload_weights` leaves two gaps, each silently wrong
log-probs: (1) `UnquantizedFusedMoEMethod._setup_kernel` runs the CPU experts' prepack only on
the first load, so reloaded experts stay in checkpoint layout: `push_weights` prepacks the
layers it pushed again; (2) an output layer tied to the embedding gets no tensor of its own,
so its packed CPU matmul weight is never rebuilt: `push_weights` rebuilds it. With prefix
caching on, cached prompt blocks keep old keys and values: `push_weights` resets the cache.
`logprobs_of` cannot see a stale prefix cache (prompt log-prob requests skip reading it).

Private vLLM internals used: the worker's `model_runner` (`input_batch`, `query_start_loc`,
`requests`, `sampler`), `MoERunner.router` / `.gate`, the CPU experts kernel (`isa`),
`cpu_prepack_moe_weight`, the output layer's `process_weights_after_loading` (docs/vllm.md).
vLLM patches torch process-wide (stream stand-ins, a no-op `set_num_threads`) and its shutdown
destroys the default process group even where megatron made it: `close()` undoes both.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np
import torch

from megatron_gspo.rollout.vllm.capture import (ROW_KEY, RoutingCapture,
                                                install_logprobs_before_top_p, runner_of)
from megatron_gspo.rollout.vllm.wire import sample_requests

CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# vLLM versions whose CPU weight reload gaps (module docstring) were read and tested here
REPREPACK_VERSIONS = ("0.32.0",)
_EXPERT_LAYER = re.compile(r"layers\.(\d+)\.mlp\.experts\.")


def unavailable(hf_dir: str | None = None) -> str | None:
    """Why the vLLM engine cannot run here (one line), or None."""
    try:  # optional dependency ([vllm] extra), and importing vLLM patches torch process-wide
        import vllm  # noqa: F401  (first: a blocked vllm fails even with vllm.platforms loaded)
        from vllm.platforms import current_platform
    except ImportError as e:
        return (f"rollout.backend=vllm needs vLLM: pip install -e '.[vllm]' (Python >= 3.11; "
                f"{e})")
    if hf_dir is None or not current_platform.is_cpu():
        return None
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if head_dim not in CPU_HEAD_DIMS:
        return (f"{hf_dir}: head_dim={head_dim} is not supported by vLLM's CPU attention "
                f"(needs one of {', '.join(map(str, CPU_HEAD_DIMS))})")
    return None


@dataclass
class EngineResult:
    """One sample: prompt ids, sampled ids [R], their log-probs [R], routing [P + R - 1, L, K]
    or None, and vLLM's finish reason ("stop" or "length")."""

    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    routing: np.ndarray | None
    finish_reason: str


# torch attributes vLLM's CPU worker replaces in the whole process: on import
# (`vllm/v1/worker/cpu/shm.py`: stand-ins for CUDA streams and events, pin_memory) and in
# `CPUWorker.init_device` (set_num_threads becomes a no-op)
_TORCH_PATCHED = ("Event", "cuda.Event", "cuda.Stream", "cuda.set_stream", "cuda.current_stream",
                  "cuda.stream", "accelerator.synchronize", "accelerator.empty_cache",
                  "accelerator.get_memory_info", "Tensor.pin_memory", "Tensor.record_stream",
                  "set_num_threads")


def _torch_attrs() -> list:
    """(owner, name, value) of each attribute in `_TORCH_PATCHED`, to put back later."""
    return [(functools.reduce(getattr, p.split(".")[:-1], torch), p.split(".")[-1],
             functools.reduce(getattr, p.split("."), torch)) for p in _TORCH_PATCHED]


class VLLMEngine:
    """An in-process `vllm.LLM` over a Hugging Face folder (see the module docstring)."""

    def __init__(self, hf_dir: str, *, dtype: str = "float32", seed: int = 0,
                 max_model_len: int = 2048, kv_cache_gb: float = 1.0,
                 capture_routing: bool = False, engine_args: dict | None = None):
        """`engine_args`: further `vllm.LLM` keyword arguments (e.g. max_num_batched_tokens),
        applied over the ones set here."""
        why = unavailable(hf_dir)
        if why:
            raise RuntimeError(why)
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype={dtype!r}: expected 'float32' or 'bfloat16'")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import vllm  # optional dependency, imported at use (see `unavailable`)

        dist = torch.distributed
        self._host = (_torch_attrs(), torch.get_num_threads(),
                      dist.is_available() and dist.is_initialized())
        if (shm := sys.modules.get("vllm.v1.worker.cpu.shm")) is not None:
            importlib.reload(shm)  # its patches again, where an earlier close() undid them
        self.llm = vllm.LLM(
            model=hf_dir, dtype=dtype, seed=seed, max_model_len=max_model_len,
            kv_cache_memory_bytes=int(kv_cache_gb * 2**30), skip_tokenizer_init=True,
            **{"logprobs_mode": "processed_logprobs", "enable_prefix_caching": not capture_routing,
               "enforce_eager": capture_routing, **(engine_args or {})})
        self.version, self.max_model_len = vllm.__version__, max_model_len
        self.prefix_caching = self.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
        # private switches: the tests turn each fix off to show it is needed
        self._reprepack = self._repack_tied_head = self._reset_prefix_cache = True
        self._pre_top_p = True
        self._call(lambda w: install_logprobs_before_top_p(runner_of(w),
                                                           lambda: self._pre_top_p))
        self.captures: list[RoutingCapture] = []  # the first one fills EngineResult.routing
        if capture_routing:
            self._add_capture("router")

    def _add_capture(self, source: str) -> RoutingCapture:
        cfg = self.llm.llm_engine.vllm_config.model_config
        capture = self._call(lambda w: RoutingCapture(
            runner_of(w), runner_of(w).get_model(), cfg.get_num_experts(),
            cfg.get_num_experts_per_tok(), source))
        self.captures.append(capture)
        return capture

    def _call(self, fn):
        """fn(worker) on the one in-process worker."""
        return self.llm.collective_rpc(fn)[0]

    def close(self) -> None:
        """Shut the engine down and undo what vLLM changed in this process: a default process
        group that existed before the engine (megatron's) is kept, where vLLM's shutdown would
        destroy it; the torch attributes in `_TORCH_PATCHED` and the thread count are put back.
        Both are process-wide: close the engines of a process together, last opened first."""
        if self.llm is None:
            return
        llm, self.llm, self.captures = self.llm, None, []
        attrs, threads, found_group = self._host
        dist, destroy = torch.distributed, torch.distributed.destroy_process_group
        if found_group:  # vLLM's shutdown destroys the default group (cleanup_dist_env_and_memory)
            dist.destroy_process_group = lambda group=None: (
                None if group in (None, dist.GroupMember.WORLD) else destroy(group))
        try:
            llm.llm_engine.engine_core.shutdown()
        finally:
            dist.destroy_process_group = destroy
        for obj, name, value in attrs:
            setattr(obj, name, value)
        torch.set_num_threads(threads)

    # ---------------------------------------------------------------- sampling
    def generate(self, prompt_ids: list[list[int]], *, n: int = 1, temperature: float = 1.0,
                 top_p: float = 1.0, max_new_tokens: int = 64, stop_ids: Iterable[int] = (),
                 greedy: bool = False, seed: int | None = None) -> list[EngineResult]:
        """`n` samples per prompt, prompt-major ([p0 s0, p0 s1, ..., p1 s0, ...]). `greedy`:
        arg-max decoding (vLLM's temperature 0; temperature and top_p ignored); `seed`: sample
        k draws with seed + k (reproducible per seed), None: vLLM's own stream."""
        from vllm import SamplingParams  # optional dependency, imported at use (`unavailable`)

        requests, params = [], []
        for k, (prompt, kwargs) in enumerate(sample_requests(
                prompt_ids, n=n, temperature=temperature, top_p=top_p,
                max_new_tokens=max_new_tokens, stop_ids=stop_ids, greedy=greedy, seed=seed,
                max_model_len=self.max_model_len)):
            requests.append({"prompt_token_ids": prompt})
            params.append(SamplingParams(**kwargs, extra_args={ROW_KEY: k}))
        for capture in self.captures:
            capture.rows, capture.active = {}, True
        try:
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        finally:
            for capture in self.captures:
                capture.active = False
        return [self._result(k, out) for k, out in enumerate(outputs)]

    def _result(self, key: int, out) -> EngineResult:
        sample = out.outputs[0]
        prompt, tokens = list(out.prompt_token_ids), list(sample.token_ids)
        logprobs = [lp[t].logprob for lp, t in zip(sample.logprobs, tokens)]
        routing = None
        if self.captures:
            routing = self.captures[0].routing(key, len(prompt) + len(tokens) - 1)
        return EngineResult(prompt, tokens, logprobs, routing, sample.finish_reason)

    def logprobs_of(self, token_ids: list[int]) -> list[float]:
        """log p(t_i | t_<i) for i = 1..len-1 at temperature 1 (vLLM's prompt log-probs)."""
        from vllm import SamplingParams  # optional dependency, imported at use (`unavailable`)

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False,
                                extra_args={ROW_KEY: -1})
        out = self.llm.generate([{"prompt_token_ids": list(token_ids)}], params,
                                use_tqdm=False)[0]
        return [lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], token_ids[1:])]

    # ---------------------------------------------------------------- weights
    def push_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load new weights by Hugging Face name, streamed (vLLM buffers a layer until all its
        tensors arrived: push in layer order, whole layers), redo the CPU packing this vLLM's
        reload skips, and reset the prefix cache. Returns the number of tensors pushed."""
        cpu_fixes = self._needs_cpu_repack()
        moe_layers: set[int] = set()
        pushed = {"count": 0, "embedding": False}

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in named_tensors:
                if (m := _EXPERT_LAYER.search(name)):
                    moe_layers.add(int(m.group(1)))
                pushed["embedding"] |= "embed_tokens" in name
                pushed["count"] += 1
                yield name, tensor

        self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=stream()))
        if cpu_fixes and self._reprepack and moe_layers:
            self._call(lambda w: _reprepack_moe(runner_of(w).get_model(), moe_layers))
        if cpu_fixes and self._repack_tied_head and pushed["embedding"]:
            self._call(lambda w: _repack_tied_lm_head(runner_of(w).get_model()))
        if self.prefix_caching and self._reset_prefix_cache:
            if not self.llm.reset_prefix_cache():
                raise RuntimeError("vLLM refused to reset its prefix cache after a weight "
                                   "push (requests still running?)")
        return pushed["count"]

    def _needs_cpu_repack(self) -> bool:
        """Whether a reload leaves CPU-packed weights stale here (see module docstring)."""
        from vllm.platforms import current_platform  # optional dependency, imported at use

        if not current_platform.is_cpu():
            return False
        if self.version not in REPREPACK_VERSIONS:
            raise RuntimeError(
                f"vLLM {self.version} on CPU: what a weight reload leaves unpacked was checked "
                f"for vLLM {', '.join(REPREPACK_VERSIONS)} only (run "
                "tests/megatron_gspo/rollout/vllm/test_engine.py and extend REPREPACK_VERSIONS)")
        return True


@torch.no_grad()
def _reprepack_moe(model: torch.nn.Module, layers: set[int]) -> int:
    """Prepack w13 / w2 of the CPU MoE experts of `layers` again, in place; returns how many
    layers were prepacked (what the experts' `process_weights_after_loading` does on the
    first load, intermediate padding aside: a padded size fails the reload itself)."""
    # vLLM's CPU-only internals (the CPU experts kernel): imported where they run
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    done = 0
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        m = _EXPERT_LAYER.search(name + ".")
        if not isinstance(experts, CPUUnquantizedExperts) or m is None:
            continue
        if int(m.group(1)) not in layers or experts._use_zentorch:
            continue
        for weight in (module.w13_weight, module.w2_weight):
            weight.data.copy_(cpu_prepack_moe_weight(weight.data, experts.isa))
        done += 1
    return done


@torch.no_grad()
def _repack_tied_lm_head(model: torch.nn.Module) -> bool:
    """Rebuild the CPU matmul of an output layer tied to the embedding; returns whether there
    was one. On CPU the output layer multiplies with a packed copy of its weight, made in its
    `process_weights_after_loading`; tied, it receives no tensor of its own in a reload, so
    vLLM never processes it again and it keeps projecting with the old embedding."""
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if weight is None or not any(m is not head and getattr(m, "weight", None) is weight
                                 for m in model.modules()):
        return False
    head.quant_method.process_weights_after_loading(head)
    return True
