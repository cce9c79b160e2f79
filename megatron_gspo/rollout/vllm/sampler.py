"""The "vllm" sampler: vLLM in this process, its weights pushed from the trainer after updates.

Shape legend: B sequences, T columns, L MoE layers, K top-k.

`VLLMSampler` runs `rollout.vllm.engine.VLLMEngine` (an in-process `vllm.LLM`) over a
config.json written from the policy's preset (any `model.preset`, or `model.hf_path`'s own
config.json with the vocabulary cut to the tokenizer's), with random weights at start
(`load_format="dummy"`): before sampling, whenever the policy's weights changed since the last
push (`MoEPolicy.version`: an optimizer step, a checkpoint load), it streams them to the engine
one tensor at a time (`moe.model.sharding.iter_full_params`: gathered over TP / EP on every rank,
never the whole model at once), named as Hugging Face names by `moe.hf.mapping`. After each
push a guard has the engine continue a fixed prompt greedily and scores the continuation with
both engine and trainer (`probe_statistic`): a |log-prob difference| above
`rollout.vllm.push_check_tol` stops the run in one line before anything is sampled from wrong
weights. A mis-packed or stale push moves log-probs by nats (docs/vllm.md). A float32 engine
agrees to float32 rounding on every token, so the guard takes the mean: one wrong token shows.
A bfloat16 engine's difference is usually hundredths of a nat but spikes: a token whose routing
flips in bfloat16 can be a nat off, and now and then most of a continuation is tenths off
(experiments/engine_mismatch prints the largest its correct runs reached), so there the guard
takes the median, and sees gross failures only (a push without the MoE re-prepack: nats; a
test places the default between the two). The engine records each MoE layer's top-k per token
(`capture_routing`): R3 replays the engine's routing, and the trainer logs the
engine-vs-trainer mismatch per layer.

Beside the trainer (`rollout.max_staleness`, engine servers only): `ServerBeside` pushes from
the trainer's thread when it publishes, and samples by that version in the producer's thread.

`metrics` after a sample: `time/weight_sync` (seconds of the last push, 0 without one) and
`rollout/push_probe_diff` (the guard's number, `probe_statistic`).

Departures: the engine's precision is `rollout.vllm.dtype` (default: the model's); one engine
per data-parallel rank, each sampling its own prompts; vLLM's own seeded draws (per request,
from the run's generator), so its tokens are not our decoders' for a seed.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time

import torch

import torch.distributed as dist

from megatron_gspo.dist import broadcast_object
from megatron_gspo.errors import ConfigError, UserError
from megatron_gspo.rollout.sampler import Samples, SamplingParams
from megatron_gspo.rollout.vllm.engine import CPU_HEAD_DIMS, VLLMEngine, unavailable
from megatron_gspo.rollout.vllm.remote import EngineLost, RemoteEngine
from megatron_gspo.rollout.vllm.wire import sample_requests
from moe.inference.engine import to_batch
from moe.hf.config import hf_config_dict, read_hf_config
from moe.hf.mapping import HFMapping, local_to_te
from moe.platform.parallel import broadcast_over_tp
from moe.model.sharding import iter_full_params

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
CHECK_TOL = {"float32": 1e-4, "bfloat16": 0.8}
"""Default `rollout.vllm.push_check_tol` by engine dtype, a bound on `probe_statistic`: a mis-packed
or stale push moves log-probs by nats (docs/vllm.md), float32 parity is ~1e-6 a token,
bfloat16's median usually hundredths of a nat, at most tenths in the runs measured: its bound
sits about as far above the largest correct value of experiments/engine_mismatch as below a
push without the MoE re-prepack (tests/megatron_gspo/rollout/vllm/test_backend.py)."""
PROBE_PROMPT, PROBE_NEW = 8, 16


class VLLMSampler:
    """`Sampler` over vLLM: an engine in this process, or engine servers (`rollout.vllm.mode`;
    see the module docstring)."""

    def __init__(self, policy, tokenizer, cfg):
        self.policy, self.tokenizer, self.num_experts = policy, tokenizer, \
            policy.preset.num_experts
        self.dtype = DTYPES.get(cfg.rollout.vllm.dtype) or DTYPES.get(cfg.model.dtype,
                                                                          "float32")
        self.tol = cfg.rollout.vllm.push_check_tol or CHECK_TOL[self.dtype]
        self.max_model_len = policy.preset.max_seq_len
        self.folder = tempfile.TemporaryDirectory(prefix="megatron_gspo_vllm_")
        self.hf_config = write_config(self.folder.name, policy, cfg)
        self.server = cfg.rollout.vllm.mode == "server"
        try:
            self.engine = self._remote(cfg) if self.server else self._in_process(cfg)
        except BaseException:
            self.folder.cleanup()  # nothing left in the temporary folder by a failed start
            raise
        g = torch.Generator().manual_seed(cfg.seed)
        self.probe = torch.randint(0, tokenizer.vocab_size, (PROBE_PROMPT,), generator=g).tolist()
        self.pushed = None  # the policy version the engine holds
        self.metrics: dict[str, float] = {}

    def _in_process(self, cfg) -> VLLMEngine:
        try:
            return VLLMEngine(self.folder.name, dtype=self.dtype, seed=cfg.seed,
                              max_model_len=self.max_model_len,
                              kv_cache_gb=cfg.rollout.vllm.kv_cache_gb,
                              capture_routing=True, engine_args={"load_format": "dummy"})
        except Exception as e:  # vLLM's start-up errors: one line naming what failed
            raise ConfigError(f"rollout.backend=vllm: the engine did not start: "
                              f"{type(e).__name__}: {str(e).splitlines()[0][:300]}") from None

    def _remote(self, cfg) -> RemoteEngine:
        rank = dist.get_rank() if dist.is_initialized() else 0
        spec = {"config": self.hf_config, "dtype": self.dtype, "seed": cfg.seed,
                "max_model_len": self.max_model_len, "capture_routing": True,
                "kv_cache_gb": cfg.rollout.vllm.kv_cache_gb}
        # what an engine server names when another trainer asks it: rank 0's, on every rank
        run = broadcast_object(f"run_dir={os.path.realpath(cfg.run_dir)} (trainer pid "
                               f"{os.getpid()} on {socket.gethostname()})")
        # megatron's rank order puts the ranks of a tensor-parallel group next to each other
        return RemoteEngine(spec, cfg.rollout.vllm, rank=rank, tp=cfg.model.tp,
                            tp_rank=rank % cfg.model.tp, run=run)

    def close(self) -> None:
        """Shut the engine down (`VLLMEngine.close`, `RemoteEngine.close`) and remove its
        config folder."""
        self.engine.close()
        self.folder.cleanup()

    def sample(self, prompts: list[list[int]], params: SamplingParams,
               generator: torch.Generator | None = None, *, pushed: bool = False) -> Samples:
        """Samples of `prompts`, after pushing the policy's weights if they changed; with
        `pushed` (servers only: `ServerBeside`, in the producer's thread) by the weights
        pushed last, neither pushing nor restarting a lost server."""
        seed = None if generator is None else \
            int(torch.randint(2 ** 31 - 1 - len(prompts), (1,), generator=generator))
        kwargs = dict(temperature=params.temperature, top_p=params.top_p,
                      max_new_tokens=params.max_new_tokens, greedy=params.greedy, seed=seed,
                      stop_ids=sorted(self.tokenizer.stop_ids))
        if self.server:
            requests = sample_requests(prompts, n=1, max_model_len=self.max_model_len,
                                       **kwargs)
            results = self._remote_generate(requests, params.record_routing, sync=False) \
                if pushed else recovering(self, lambda: self._remote_generate(
                    requests, params.record_routing))
        else:
            self.sync()
            results = self.engine.generate(prompts, **kwargs)
        tokens_BT, valid_BT, response_BT, logp_BT, routing = to_batch(
            results, self.tokenizer.pad_id, self.num_experts)
        return Samples(tokens_BT, valid_BT, response_BT, logp_BT,
                       routing if params.record_routing else None)

    def beside(self, make_policy) -> "ServerBeside":
        """Sampling beside the trainer (`rollout.max_staleness`): engine servers only (the
        backend's `beside` capability); `make_policy` is not needed (the engine holds its own
        weights)."""
        if not self.server:
            raise ConfigError("rollout.max_staleness > 0 with rollout.backend=vllm needs "
                              "rollout.vllm.mode=server")
        return ServerBeside(self)

    def _remote_generate(self, requests, routes: bool, sync: bool = True):
        """Push if needed (`sync`), then this rank's samples (the first rank of a
        tensor-parallel group asks its engine server and hands them to the others)."""
        if sync:
            self.sync()
        results, lost = None, None
        if self.engine.sender:
            try:
                results = self.engine.generate(requests, self.pushed, routes=routes)
            except EngineLost as e:
                lost = (e.replica, e.why)
        results, lost = broadcast_over_tp((results, lost))
        if lost is not None:
            raise EngineLost(*lost)
        return results

    def sync(self) -> None:
        """Push the policy's weights if they changed since the last push, then check them."""
        self.metrics = {"time/weight_sync": 0.0}
        if self.server:
            self.metrics["rollout/engine_restarts"] = self.engine.restarts
        if self.pushed == self.policy.version:
            return
        t0 = time.perf_counter()
        failure = None  # in server mode every rank hears it in probe_diff's broadcast
        try:
            if self.server:
                self.engine.push(hf_stream(self.policy, self.hf_config), self.policy.version)
            else:
                self.engine.push_weights(hf_stream(self.policy, self.hf_config))
        except EngineLost as e:
            failure = e
        except Exception as e:  # a push that fails: one line, nothing sampled
            failure = ConfigError(f"rollout.backend=vllm: pushing the weights (version "
                                  f"{self.policy.version}) failed: {type(e).__name__}: "
                                  f"{str(e).splitlines()[0][:300]}")
            if not self.server:
                raise failure from None
        self.metrics["time/weight_sync"] = time.perf_counter() - t0
        self.metrics["rollout/push_probe_diff"] = diff = self.probe_diff(failure)
        if not diff <= self.tol:
            raise ConfigError(f"rollout.backend=vllm: after pushing the weights (version "
                              f"{self.policy.version}) the engine's log-probs of a probe "
                              f"sequence differ from the trainer's by {diff:.3g} ({STATISTIC[self.dtype]}) > "
                              f"rollout.vllm.push_check_tol={self.tol:g}: stopping before sampling "
                              "from wrong weights")
        self.pushed = self.policy.version

    def probe_diff(self, failure: Exception | None = None) -> float:
        """`probe_statistic` of the engine's and the trainer's log-probs (temperature 1) of the
        engine's greedy continuation of the probe prompt; in server mode the largest over the
        replicas (rank 0 asks them and tells every rank the sequences, or its `failure`;
        every rank runs the trainer's forward)."""
        if not self.server:
            seq = self.probe + self.engine.generate([self.probe], greedy=True,
                                                    max_new_tokens=PROBE_NEW)[0].tokens
            return self._statistic(seq, self.engine.logprobs_of(seq))
        probes = None
        if failure is None and self.engine.rank == 0:
            try:
                probes = [self._probe_replica(r) for r in range(self.engine.replicas)]
            except EngineLost as e:
                failure = e
            except RuntimeError as e:
                failure = ConfigError(f"rollout.backend=vllm: the probe after pushing the "
                                      f"weights (version {self.policy.version}) failed: {e}")
        probes = broadcast_object(
            ("lost", failure.replica, failure.why) if isinstance(failure, EngineLost) else
            ("error", str(failure)) if failure is not None else probes)
        if probes[0] == "lost":
            raise EngineLost(*probes[1:])
        if probes[0] == "error":
            raise ConfigError(probes[1])
        return max(self._statistic(seq, theirs) for seq, theirs in probes)

    def _probe_replica(self, replica: int) -> tuple[list[int], list[float]]:
        greedy = sample_requests([self.probe], n=1, temperature=1.0, top_p=1.0,
                                 max_new_tokens=PROBE_NEW, stop_ids=(), greedy=True, seed=None,
                                 max_model_len=self.max_model_len)
        seq = self.probe + self.engine.generate(greedy, self.policy.version, routes=False,
                                                replica=replica)[0].tokens
        return seq, self.engine.logprobs_of(seq, self.policy.version, replica)

    @torch.no_grad()
    def _statistic(self, seq: list[int], theirs: list[float]) -> float:
        P = len(self.probe)
        ids_1T = torch.tensor([seq])
        was = self.policy.model.training
        self.policy.train(False)
        try:
            ours = self.policy.token_logprobs(ids_1T, torch.ones_like(ids_1T, dtype=torch.bool))
        finally:
            self.policy.train(was)
        return probe_statistic(ours[0, P:].cpu(), torch.tensor(theirs[P - 1:]), self.dtype)


class ServerBeside:
    """`rollout.overlap.Beside` over engine servers: the trainer's thread pushes (`publish`:
    `VLLMSampler.sync`, restarting lost servers as a rollout does), the producer's thread
    samples by the version pushed, and a server lost while it sampled is restarted from the
    trainer's thread (`recover`), within `rollout.vllm.max_restarts`."""

    def __init__(self, sampler: VLLMSampler):
        self.sampler = sampler
        self.restarts = 0  # the engine's restarts when it last published

    def publish(self) -> dict:
        recovering(self.sampler, self.sampler.sync)
        self.restarts = self.sampler.engine.restarts
        return dict(self.sampler.metrics)

    def sample(self, prompts: list[list[int]], params: SamplingParams,
               generator: torch.Generator | None = None) -> Samples:
        return self.sampler.sample(prompts, params, generator, pushed=True)

    def recover(self, error: Exception) -> None:
        lost = error if isinstance(error, EngineLost) else None
        if lost is not None and self.sampler.engine.restarts > self.restarts:
            return  # restarted since (by an eval's request): the next publish pushes
        if not restart_lost(self.sampler, lost, None if lost else error):
            raise error

    def close(self) -> None:
        pass  # the run's sampler closes the engine servers


def recovering(sampler: VLLMSampler, fn):
    """`fn()`, after restarting the engine servers lost while it ran and re-pushing, as often
    as `rollout.vllm.max_restarts` allows (`restart_lost`)."""
    while True:
        lost = error = out = None
        try:
            out = fn()
        except EngineLost as e:
            lost = e
        except Exception as e:  # raised below on every rank, not on this one alone
            error = e
        if not restart_lost(sampler, lost, error):
            return out


def restart_lost(sampler: VLLMSampler, lost: EngineLost | None, error: Exception | None) -> bool:
    """After an attempt that lost an engine (`lost`) or failed otherwise (`error`) on this
    rank: restart the engine servers any rank lost (`RemoteEngine.restart`, which stops in one
    line past `rollout.vllm.max_restarts`) and forget the push; True when it restarted some,
    False when none was lost. Collective: every rank learns which engines any rank lost, and
    raises when any rank failed otherwise."""
    replicas, failed = sampler.engine.lost_replicas(lost, error is not None)
    if failed:
        if error is not None:
            raise error
        raise UserError("rollout.vllm: a request of another trainer rank to its engine "
                        "server failed (its message is in that rank's output)")
    if not replicas:
        return False
    sampler.engine.restart(replicas, str(lost) if lost else
                           f"engine server(s) {replicas} exited")
    sampler.pushed = None
    sampler.metrics["rollout/engine_restarts"] = sampler.engine.restarts
    return True


STATISTIC = {"float32": "mean", "bfloat16": "median"}


def probe_statistic(ours_T: torch.Tensor, theirs_T: torch.Tensor, dtype: str) -> float:
    """The stale-weight guard's number over the probe's tokens: the mean |ours - theirs|
    (log-probs) for a float32 engine, where one wrong token must show; the median (halfway
    between the middle two) for a bfloat16 one, where one token whose routing flips moves
    alone and a wrong push moves them all."""
    diff_T = (ours_T.double() - theirs_T.double()).abs()
    return float(diff_T.mean() if STATISTIC[dtype] == "mean" else diff_T.quantile(0.5))


def write_config(folder: str, policy, cfg) -> dict:
    """config.json of the policy's architecture with the tokenizer's vocabulary (the preset's
    padding rows are never pushed, so vLLM never samples them); `model.hf_path`'s other keys
    kept. Returns it."""
    base = read_hf_config(cfg.model.hf_path) if cfg.model.hf_path else None
    try:
        hf_config = hf_config_dict(policy.preset, policy.real_vocab, DTYPES[cfg.model.dtype]
                                   if cfg.model.dtype in DTYPES else "float32", base)
    except ValueError as e:
        raise ConfigError(f"rollout.backend=vllm: {e}") from None
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf_config, f)
    return hf_config


def hf_stream(policy, hf_config: dict):
    """The policy's weights as (Hugging Face name, tensor), one megatron parameter at a time
    (a MoE layer's stacked expert weight: each expert's tensors), gathered over TP / EP
    (collective: every rank pulls the whole stream), vocabulary padding cut."""
    mapping, vocab = HFMapping(hf_config), hf_config["vocab_size"]
    # which layers are MoE (local_to_te reads it off the router names)
    routers = [n for n, _ in policy.model.module.named_parameters() if ".mlp.router." in n]
    for name, tensor in iter_full_params(policy.model.module):
        te_name = local_to_te([name, *routers])[name]
        for hf_name, part in mapping.to_hf(te_name, tensor):
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                part = part[:vocab]
            yield hf_name, part.contiguous()


def factory(policy, tokenizer, cfg) -> VLLMSampler:
    """Backend "vllm"'s factory (registered in `megatron_gspo.rollout.backends`)."""
    if not torch.cuda.is_available() and policy.preset.kv_channels not in CPU_HEAD_DIMS:
        raise ConfigError(f"rollout.backend=vllm: head_dim={policy.preset.kv_channels} is not "
                          f"supported by vLLM's CPU attention (needs one of "
                          f"{', '.join(map(str, CPU_HEAD_DIMS))})")
    return VLLMSampler(policy, tokenizer, cfg)


factory.unavailable = unavailable  # checked before any set-up
