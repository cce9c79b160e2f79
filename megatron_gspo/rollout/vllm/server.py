"""A vLLM engine server: vLLM with its own tensor parallelism, for `rollout.vllm.mode=server`.

Shape legend: P prompt tokens, R sampled tokens, L MoE layers, K experts per token (top-k).

    python -m megatron_gspo.rollout.vllm.server --host 0.0.0.0 --port 8123 \\
        --tensor-parallel-size 8      # then rollout.vllm.addresses=["engine-host:8123"]

The trainer starts one per replica itself unless `rollout.vllm.addresses` names running ones.
A server binds its port first (a port in use is one line on stderr and exit status 2), then
answers trainer ranks (`vllm_wire.Channel`, one connection each) one message at a time. Every
message names the run it comes from (`run`: the trainer's run dir, host and pid): a server
serves one run at a time, until the last of its connections closes, and refuses another's
messages naming the run it serves (each trainer counts weight versions from 0, so a second
trainer's build or push would mix its weights into the first one's rollouts).

- `build`: the model (the trainer's config.json, dtype, seed, lengths, KV cache): a `vllm.LLM`
  over random weights (`load_format="dummy"`) with `tensor_parallel_size` workers (vLLM's
  multiprocessing executor; the engine core runs in this process), `worker`'s extension
  and weight-transfer backend; the config.json's temporary folder is removed once built. A
  server keeps the model it built; another model is refused naming what differs. Every build
  forgets the weights' version: nothing is sampled until the trainer pushed.
- `init_weights` / `push`: vLLM's weight-transfer calls (`worker.GroupWeightTransfer`);
  a push waits until no request is in flight, then stamps the weights with its version
  (`LLM.finish_weight_update(weight_version=...)`).
- `generate`: requests (prompt ids and `SamplingParams` arguments, `vllm_wire.sample_requests`)
  that must name the version the server holds. They join the requests of every connected rank
  in one engine; the server steps it and streams each rank its finished samples (tokens, the
  sampler's log-probs, prompt log-probs on request and, with routing, the routes [P + R - 1,
  L, K], uint8 for E <= 256) in chunks of about `chunk_mb` MiB of routes.
- `close`: the server exits.

Host memory for routes: worker 0 holds the routes of the requests in flight (at most vLLM's
max_num_seqs of them, each under max_model_len tokens: max_num_seqs * max_model_len * L * K
bytes), this process at most one chunk per connected rank beyond the request that crossed the
mark; neither grows with the batch.

`--parent-pid` (set by a trainer that starts the server): the kernel kills the server when
that process dies, and its workers when the server dies (`moe.platform.children.die_with_parent`). An
engine that fails (a worker killed, an error in a step) makes the server tell every rank and
exit with status 1; the trainer restarts it (`rollout.vllm.max_restarts`).
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import shutil
import socket
import sys
import tempfile
import time
import traceback

from megatron_gspo.rollout.vllm.capture import ROW_KEY
from megatron_gspo.rollout.vllm.engine import unavailable
from megatron_gspo.rollout.vllm.wire import (BACKEND, ERROR_PREFIX, WORKER_EXTENSION, Channel,
                                             ChannelClosed, auth_key, challenge)
from moe.platform.children import die_with_parent

MSG_TIMEOUT_S = 120.0
"""How long the rest of a message may take once its first byte arrived."""


def fail(message: str, status: int = 2):
    print(ERROR_PREFIX + message, file=sys.stderr, flush=True)
    sys.exit(status)


def build_llm(spec: dict, tp: int):
    """The `vllm.LLM` of a build message, with this module's workers; returns (llm, layers)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    import vllm  # the server's one heavy import, after the port is bound (a busy port: fast)

    folder = tempfile.mkdtemp(prefix="megatron_gspo_vllm_server_")
    try:  # vLLM reads the config.json while it builds; the folder goes with the build
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(spec["config"], f)
        why = unavailable(folder)
        if why:
            raise RuntimeError(why)
        from vllm.platforms import current_platform  # loaded with vllm above

        per_worker, _ = divmod(spec["config"].get("moe_intermediate_size") or 32, tp)
        if current_platform.is_cpu() and per_worker % 32:
            raise RuntimeError(  # the CPU experts kernel pads it, and a reload then fails
                f"moe_intermediate_size / tensor_parallel_size = {per_worker} is not a multiple "
                "of 32, which vLLM's CPU experts kernel pads to; weight pushes fail on a padded "
                "layer: use a tensor_parallel_size that leaves a multiple of 32")
        capture = spec["capture_routing"]
        llm = vllm.LLM(
            model=folder, dtype=spec["dtype"], seed=spec["seed"],
            max_model_len=spec["max_model_len"],
            kv_cache_memory_bytes=int(spec["kv_cache_gb"] * 2**30), skip_tokenizer_init=True,
            logprobs_mode="processed_logprobs", load_format="dummy",
            enable_prefix_caching=not capture, enforce_eager=capture, tensor_parallel_size=tp,
            distributed_executor_backend="mp" if tp > 1 else "uni",
            worker_extension_cls=WORKER_EXTENSION, weight_transfer_config={"backend": BACKEND})
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    layers = max(llm.collective_rpc("mg_setup", kwargs={"capture_routing": capture,
                                                        "server_pid": os.getpid()}))
    return llm, layers


def spec_difference(held: dict, asked: dict) -> str:
    """What differs between the model a server holds and a build message's (its config.json's
    keys one by one): "seed: the server's 0, this run's 1; ..."."""
    def flat(spec: dict) -> dict:
        out = {k: v for k, v in spec.items() if k != "config"}
        out.update((f"config.json {k}", v) for k, v in (spec.get("config") or {}).items())
        return out

    a, b = flat(held), flat(asked)
    return "; ".join(f"{k}: the server's {a.get(k)!r}, this run's {b.get(k)!r}"
                     for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))


class Server:
    """The loop: connections, engine steps, pushes (see the module docstring)."""

    def __init__(self, listener: socket.socket, tp: int):
        self.listener, self.tp, self.key = listener, tp, auth_key()
        self.sel = selectors.DefaultSelector()
        self.sel.register(listener, selectors.EVENT_READ)
        self.llm = self.spec = self.version = None
        self.layers = 0
        self.chunk_bytes = 16 << 20
        self.requests: dict[str, dict] = {}  # vLLM request id -> its row's bookkeeping
        self.calls: dict[tuple, dict] = {}  # (channel, call id) -> rows left, outbox
        self.pending_push: tuple | None = None  # (channel, message) waiting for no requests
        self.next_key = 0
        self.runs: dict[Channel, str] = {}  # channel -> the run it speaks for (one run at once)

    # ------------------------------------------------------------------ the loop
    def serve(self) -> None:
        while True:
            busy = self.llm is not None and self.llm.llm_engine.has_unfinished_requests()
            for key, _ in self.sel.select(timeout=0 if busy else None):
                if key.fileobj is self.listener:
                    self.accept()
                elif self.handle(key.fileobj) == "close":
                    return
            if busy:
                self.step()
            elif self.pending_push is not None:
                self.push(*self.pending_push)
                self.pending_push = None

    def accept(self) -> None:
        sock, _ = self.listener.accept()
        chan = Channel(sock)
        if challenge(chan, self.key, MSG_TIMEOUT_S):
            self.sel.register(chan, selectors.EVENT_READ)
        else:
            chan.close()

    def drop(self, chan: Channel) -> None:
        """A rank went away: its requests are aborted, its calls forgotten."""
        self.sel.unregister(chan)
        chan.close()
        self.runs.pop(chan, None)  # the last rank of a run gone: the server is free
        ids = [rid for rid, r in self.requests.items() if r["chan"] is chan]
        if ids:
            self.llm.llm_engine.abort_request(ids)
            self.pop_routes({self.requests.pop(rid)["key"]: None for rid in ids})
        self.calls = {k: v for k, v in self.calls.items() if k[0] is not chan}

    def handle(self, chan: Channel) -> str | None:
        try:
            msg = chan.recv(MSG_TIMEOUT_S)
        except (ChannelClosed, TimeoutError):
            self.drop(chan)
            return None
        op = msg["op"]
        held = {run for other, run in self.runs.items() if other is not chan}
        if held and msg.get("run") not in held:  # a second trainer: refused, nothing changed
            chan.send({"busy": True, "error": f"this engine server serves another run, "
                       f"{held.pop()}: it serves one trainer at a time (another run's weights "
                       "or versions would mix with these): give this run its own server"})
            return None
        self.runs[chan] = msg.get("run")
        try:
            if op == "push":  # after the requests in flight
                self.pending_push = (chan, msg)
                return None
            reply = getattr(self, "op_" + op)(chan, msg)
        except Exception as e:  # the rank hears what failed; the server goes on
            reply = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:500]}"}
        if reply is not None:
            chan.send(reply)
        return "close" if op == "close" else None

    # ------------------------------------------------------------------ operations
    def op_hello(self, chan, msg) -> dict:
        return {"ok": True, "pid": os.getpid(), "tp": self.tp, "built": self.llm is not None}

    def op_close(self, chan, msg) -> dict:
        return {"ok": True}

    def op_build(self, chan, msg) -> dict:
        spec = msg["spec"]
        if self.llm is None:
            self.llm, self.layers = build_llm(spec, self.tp)
            self.spec = spec
        elif spec != self.spec:
            raise RuntimeError(f"this engine server holds another model "
                               f"({spec_difference(self.spec, spec)}): start a new one")
        self.version, self.chunk_bytes = None, int(msg["chunk_mb"] * 2**20)
        import vllm  # the version reported (imported by build_llm)

        return {"ok": True, "layers": self.layers, "vllm": vllm.__version__}

    def op_init_weights(self, chan, msg) -> dict:
        self.llm.collective_rpc("shutdown_weight_transfer_engine")
        self.llm.init_weight_transfer_engine({"init_info": msg["init_info"]})
        return {"ok": True}

    def push(self, chan, msg) -> None:
        t0 = time.perf_counter()
        try:
            self.version = None  # weights in between versions until the push completes
            self.llm.start_weight_update()
            self.llm.update_weights({"update_info": {"version": msg["version"]}})
            self.llm.finish_weight_update(weight_version=str(msg["version"]))
            if self.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching:
                self.llm.reset_prefix_cache()
            self.version = msg["version"]
            reply = {"ok": True, "seconds": time.perf_counter() - t0}
        except Exception as e:
            reply = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:500]}"}
        try:
            chan.send(reply)
        except ChannelClosed:
            self.drop(chan)

    def op_generate(self, chan, msg) -> None:
        # loaded with the engine (build_llm)
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        if self.llm is None or msg["version"] != self.version:
            raise RuntimeError(f"the engine holds weights of version {self.version}, the "
                               f"request is for version {msg['version']}: push first")
        call = (chan, msg["call"])
        self.calls[call] = {"left": len(msg["requests"]), "out": [], "bytes": 0}
        for row, (prompt, kwargs) in enumerate(msg["requests"]):
            key, self.next_key = self.next_key, self.next_key + 1
            if msg["prompt_logprobs"]:
                kwargs = dict(kwargs, prompt_logprobs=0)
            params = SamplingParams(**kwargs, extra_args={ROW_KEY: key},
                                    output_kind=RequestOutputKind.FINAL_ONLY)
            self.requests[str(key)] = {"chan": chan, "call": call, "row": row, "key": key,
                                       "routes": msg["routes"],
                                       "prompt_logprobs": msg["prompt_logprobs"]}
            self.llm.llm_engine.add_request(str(key), {"prompt_token_ids": prompt}, params)
        return None

    # ------------------------------------------------------------------ stepping
    def step(self) -> None:
        finished = [out for out in self.llm.llm_engine.step() if out.finished]
        if not finished:
            return
        infos = [self.requests.pop(out.request_id) for out in finished]
        lengths = {info["key"]: (len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1
                                 if info["routes"] else None)
                   for out, info in zip(finished, infos)}
        routes = self.pop_routes(lengths)
        for out, info in zip(finished, infos):
            self.deliver(out, info, routes.get(info["key"]))

    def pop_routes(self, lengths: dict) -> dict:
        if not self.layers:
            return {}
        idle = not self.requests
        found = [r for r in self.llm.collective_rpc("mg_pop_routes", args=(lengths, idle))
                 if r is not None]
        return found[0] if found else {}

    def deliver(self, out, info: dict, routes) -> None:
        sample = out.outputs[0]
        tokens = list(sample.token_ids)
        row = {"row": info["row"], "prompt": list(out.prompt_token_ids), "tokens": tokens,
               "logprobs": [lp[t].logprob for lp, t in zip(sample.logprobs, tokens)],
               "finish_reason": sample.finish_reason, "routes": routes}
        if info["prompt_logprobs"]:
            row["prompt_logprobs"] = [lp[t].logprob for lp, t in
                                      zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
        call = self.calls.get(info["call"])
        if call is None:  # the rank went away
            return
        call["out"].append(row)
        call["bytes"] += 0 if routes is None else routes.nbytes
        call["left"] -= 1
        if call["left"] == 0 or call["bytes"] >= self.chunk_bytes:
            done = call["left"] == 0
            msg = {"rows": call["out"], "done": done, "version": self.version}
            call["out"], call["bytes"] = [], 0
            if done:
                del self.calls[info["call"]]
            try:
                info["chan"].send(msg)
            except ChannelClosed:
                self.drop(info["chan"])


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(64)
    return sock


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m megatron_gspo.rollout.vllm.server",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--parent-pid", type=int, help="exit when this process (a trainer) dies")
    args = p.parse_args(argv)
    if args.parent_pid is not None:
        die_with_parent(args.parent_pid)
    try:
        listener = bind(args.host, args.port)
    except OSError as e:
        fail(f"cannot listen on {args.host}:{args.port}: {e.strerror or e} (port in use? "
             "set rollout.vllm.port or --port to a free one)")
    print(f"megatron_gspo vllm server listening on {args.host}:{args.port}, pid {os.getpid()}",
          flush=True)
    server = Server(listener, args.tensor_parallel_size)
    try:
        server.serve()
    except Exception as e:  # the engine failed: every rank hears it, the trainer restarts it
        traceback.print_exc()
        line = f"the engine failed: {type(e).__name__}: {str(e).splitlines()[0][:500]}" \
            if str(e) else f"the engine failed: {type(e).__name__}"
        for key in list(server.sel.get_map().values()):
            if isinstance(key.fileobj, Channel):
                try:
                    key.fileobj.send({"error": line, "engine_failed": True})
                except ChannelClosed:
                    pass
        fail(line, status=1)
    try:  # vLLM's workers stop with its engine core (and die with this process anyway)
        if server.llm is not None:
            server.llm.llm_engine.engine_core.shutdown()
    finally:
        os._exit(0)


if __name__ == "__main__":
    main()
