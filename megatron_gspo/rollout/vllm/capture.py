"""Routing capture inside an in-process vLLM engine (`megatron_gspo.rollout.vllm.engine`).

Shown on CPU, V1 model runner (on a GPU vLLM's `enable_return_routed_experts` is the path): each
MoE layer's router calls a capture function with the top-k ids it hands to the expert kernel
(`BaseRouter.set_capture_fn`, which vLLM's GPU `RoutedExpertsCapturer` uses). A pre-hook on the
model records each step's request order, `query_start_loc` and positions, so every row lands at its
(request, position) whatever the batching or prefill chunking; requests are told apart by an index
in their SamplingParams' `extra_args`.

Shape legend: N tokens in one engine step, L MoE layers, K experts per token (top-k).
"""

from __future__ import annotations

import numpy as np
import torch

ROW_KEY = "megatron_gspo_row"
"""The key in a request's `SamplingParams.extra_args` that holds its row index."""


def runner_of(worker):
    """The model runner of vLLM's in-process worker (or of its wrapper)."""
    return getattr(worker, "worker", worker).model_runner


def install_logprobs_before_top_p(runner, enabled=lambda: True) -> None:
    """Make the runner's sampler report the log-softmax of the (temperature-divided) logits its
    top-k/top-p step receives, before the mask, while `enabled()` (docs/vllm.md, "Log-probs";
    the engine runs `logprobs_mode="processed_logprobs"`)."""
    sampler = runner.sampler.topk_topp_sampler
    inner = sampler.forward

    def forward(logits, generators, k, p):
        if not enabled():
            return inner(logits, generators, k, p)
        logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)  # before the mask
        sampled, _ = inner(logits, generators, k, p)
        return sampled, logprobs

    sampler.forward = forward


class RoutingCapture:
    """Top-k ids per (request row, position) from the MoE routers of an in-process engine."""

    def __init__(self, runner, model, num_experts: int, top_k: int, source: str = "router"):
        self.runner, self.dtype = runner, np.uint8 if num_experts <= 256 else np.int16
        runners = [m for m in model.modules()
                   if hasattr(m, "router") and hasattr(m.router, "set_capture_fn")]
        if not runners:
            raise RuntimeError("no vLLM MoE router with set_capture_fn found in the model")
        self.num_layers, self.max_batch = len(runners), 0
        self.active, self.step, self.rows = False, None, {}
        model.register_forward_pre_hook(self._begin_step, with_kwargs=True)
        model.register_forward_hook(self._end_step)
        for layer, runner_ in enumerate(runners):
            if source == "router":  # the ids the expert kernel receives
                runner_.router.set_capture_fn(lambda ids, i=layer: self._capture(i, ids))
            else:  # "gate": top-k of the router logits (a second path, for tests)
                runner_.gate.register_forward_hook(lambda m, a, out, i=layer: self._capture(
                    i, (out[0] if isinstance(out, tuple) else out).topk(top_k, dim=-1).indices))

    def _begin_step(self, module, args, kwargs):
        if not self.active:
            return
        runner = self.runner
        positions = kwargs["positions"] if "positions" in kwargs else args[1]
        num_reqs = runner.input_batch.num_reqs
        starts = runner.query_start_loc.np[:num_reqs + 1].copy()
        keys = [runner.requests[r].sampling_params.extra_args[ROW_KEY]
                for r in runner.input_batch.req_ids[:num_reqs]]
        n = int(starts[-1])
        self.step = dict(keys=keys, starts=starts,
                         positions=positions[:n].cpu().numpy().copy(),
                         ids=[None] * self.num_layers)
        self.max_batch = max(self.max_batch, num_reqs)

    def _capture(self, layer: int, ids_NK: torch.Tensor) -> None:
        if self.active and self.step is not None:
            n = len(self.step["positions"])
            self.step["ids"][layer] = ids_NK[:n].cpu().numpy().astype(self.dtype)

    def _end_step(self, module, args, output):
        step, self.step = self.step, None
        if not self.active or step is None:
            return
        missing = [i for i, ids in enumerate(step["ids"]) if ids is None]
        if missing:
            raise RuntimeError(f"routing capture: MoE layers {missing} reported no routing "
                               "this step (a compiled model skips hooks: enforce_eager)")
        ids_NLK = np.stack(step["ids"], axis=1)
        for b, key in enumerate(step["keys"]):
            lo, hi = step["starts"][b], step["starts"][b + 1]
            self.rows.setdefault(key, []).append((step["positions"][lo:hi], ids_NLK[lo:hi]))

    def routing(self, key: int, length: int) -> np.ndarray:
        """Routing [length, L, K] of row `key`; every position must have been captured."""
        parts = self.rows.get(key, [])
        out = np.zeros((length, self.num_layers, parts[0][1].shape[2] if parts else 0),
                       self.dtype)
        seen = np.zeros(length, bool)
        for pos, ids in parts:
            keep = pos < length  # a step past the end (async scheduling) is dropped
            out[pos[keep]], seen[pos[keep]] = ids[keep], True
        if not seen.all():
            raise RuntimeError(f"routing capture: row {key} has no routing at positions "
                               f"{np.flatnonzero(~seen)[:8].tolist()} (prefix cache on?)")
        return out
