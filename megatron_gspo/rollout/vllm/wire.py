"""What the trainer and the vLLM engine servers exchange, and how (`rollout.vllm.mode=server`).

Shape legend: N bytes of one bucket's payload.

Control and samples travel over one TCP socket per trainer rank and server (`Channel`): each
message one pickled dict behind an 8-byte length, every receive bounded by a timeout; a
connection starts with an HMAC challenge on a shared key (`MEGATRON_GSPO_VLLM_KEY`, else a
built-in one: set the variable on both sides when the port is reachable by others), so a
server unpickles nothing from a peer that does not hold the key.

Weights travel over a torch.distributed process group of its own (`open_group`: a TCPStore
rendezvous and a gloo group on CPU, NCCL on a GPU) between the trainer's rank 0 (group rank 0)
and every engine worker (rank 1 + the workers of the replicas before + worker), apart from the
trainer's own groups. A push is a sequence of broadcasts from rank 0 (`send_buckets`,
`receive_buckets`): per bucket a two-int64 header [H, N], H bytes of pickled metadata
(names, dtypes, shapes, the weights' version) and N bytes of payload, the tensors packed end to
end; [0, count] ends the push. A receiver unpacks a bucket into views of its payload.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import socket
import struct
import time
from datetime import timedelta
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

BACKEND = "megatron_gspo_group"
"""The name `worker.GroupWeightTransfer` registers under in vLLM's weight-transfer registry."""
WORKER_EXTENSION = "megatron_gspo.rollout.vllm.worker.WorkerExtension"
"""vLLM's `worker_extension_cls` of the engine servers (importing it registers BACKEND)."""
KEY_ENV = "MEGATRON_GSPO_VLLM_KEY"
DEFAULT_KEY = b"megatron-gspo-vllm"
ERROR_PREFIX = "ENGINE SERVER ERROR: "
"""The server's last line on stderr when it stops on an error (the trainer repeats it)."""
_LEN = struct.Struct("!Q")


class ChannelClosed(ConnectionError):
    """The peer closed the connection (or the process behind it died)."""


def auth_key() -> bytes:
    """The shared key: $MEGATRON_GSPO_VLLM_KEY, else the built-in one."""
    key = os.environ.get(KEY_ENV)
    return key.encode() if key else DEFAULT_KEY


class Channel:
    """Length-prefixed pickled messages over a connected socket, each receive with a timeout."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, msg: dict) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self.sock.sendall(_LEN.pack(len(data)) + data)
        except OSError as e:
            raise ChannelClosed(f"sending failed: {e}") from None

    def recv(self, timeout: float | None = None) -> dict:
        """The next message; TimeoutError after `timeout` seconds without one, ChannelClosed
        when the peer is gone."""
        size = _LEN.unpack(self._read(_LEN.size, timeout))[0]
        return pickle.loads(self._read(size, timeout))

    def _read(self, n: int, timeout: float | None) -> bytes:
        buf = bytearray()
        try:
            self.sock.settimeout(timeout)
            while len(buf) < n:
                part = self.sock.recv(min(n - len(buf), 1 << 22))
                if not part:
                    raise ChannelClosed("the peer closed the connection")
                buf += part
        except socket.timeout:
            raise TimeoutError(f"no message within {timeout:g} s") from None
        except OSError as e:  # reset, broken pipe, or closed here by another thread
            raise ChannelClosed(str(e)) from None
        return bytes(buf)

    def close(self) -> None:
        """Shut the connection down, then close it: a thread blocked receiving on it wakes
        (a close alone leaves it waiting out its timeout)."""
        for end in (lambda: self.sock.shutdown(socket.SHUT_RDWR), self.sock.close):
            try:
                end()
            except OSError:
                pass


def _digest(key: bytes, challenge: bytes) -> bytes:
    return hmac.new(key, challenge, hashlib.sha256).digest()


def challenge(chan: Channel, key: bytes, timeout: float) -> bool:
    """Server side: whether the peer proves it holds `key` (raw bytes, before any pickle)."""
    nonce = os.urandom(32)
    chan.sock.sendall(nonce)
    try:
        answer = chan._read(32, timeout)
    except (TimeoutError, ChannelClosed):
        return False
    ok = hmac.compare_digest(answer, _digest(key, nonce))
    chan.sock.sendall(b"\x01" if ok else b"\x00")
    return ok


def connect(host: str, port: int, key: bytes, timeout: float) -> Channel:
    """A `Channel` to a server; ConnectionRefusedError / TimeoutError / PermissionError (wrong
    key) otherwise."""
    sock = socket.create_connection((host, port), timeout=timeout)
    chan = Channel(sock)
    try:
        nonce = chan._read(32, timeout)
        chan.sock.sendall(_digest(key, nonce))
        if chan._read(1, timeout) != b"\x01":
            raise PermissionError(f"{host}:{port} refused the key (${KEY_ENV} differs)")
    except BaseException:
        chan.close()
        raise
    return chan


def sample_requests(prompt_ids: list[list[int]], *, n: int, temperature: float, top_p: float,
                    max_new_tokens: int, stop_ids: Iterable[int], greedy: bool,
                    seed: int | None, max_model_len: int) -> list[tuple[list[int], dict]]:
    """(prompt ids, vLLM `SamplingParams` keyword arguments) of each sample, `n` per prompt,
    prompt-major; sample k of the batch draws with seed + k (None: vLLM's own stream). Only
    `stop_ids` stop a sample (the stop token kept); log-probs of the sampled tokens."""
    if not (greedy or temperature > 0):
        raise ValueError(f"temperature={temperature}: sampling needs temperature > 0")
    longest = max(len(p) for p in prompt_ids) + max_new_tokens
    if longest > max_model_len:
        raise ValueError(f"prompt + max_new_tokens = {longest} exceeds max_model_len="
                         f"{max_model_len}")
    out = []
    for i, prompt in enumerate(prompt_ids):
        for j in range(n):
            out.append((list(prompt), dict(
                n=1, temperature=0.0 if greedy else temperature, top_p=1.0 if greedy else top_p,
                max_tokens=max_new_tokens, stop_token_ids=list(stop_ids), ignore_eos=True,
                logprobs=0, detokenize=False,
                seed=None if seed is None else seed + i * n + j)))
    return out


# ------------------------------------------------------------------------ the weight group
class WeightGroup:
    """This process's member of the weight-sync group (`open_group`)."""

    def __init__(self, pg, store, device: torch.device):
        self.pg, self.store, self.device = pg, store, device  # the store lives with the group

    def broadcast(self, tensor: torch.Tensor) -> None:
        """`tensor` from group rank 0 into every member's `tensor` (same shape and dtype)."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        self.pg.broadcast([tensor], opts).wait()


def rendezvous(host: str, port: int, rank: int, timeout_s: float):
    """The weight-sync group's TCPStore at host:port; rank 0 hosts it (and fails at once,
    `torch.distributed.DistNetworkError`, where the port is in use)."""
    return dist.TCPStore(host, port, None, rank == 0, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def open_group(host: str, port: int, rank: int, world_size: int, timeout_s: float,
               device: torch.device, store=None) -> WeightGroup:
    """This process's member of the weight-sync group (rank 0 hosts the rendezvous, `store`
    when it opened it already): a gloo process group on CPU, NCCL on a CUDA device;
    independent of torch.distributed's default group. Blocks until all `world_size` members
    joined."""
    timeout = timedelta(seconds=timeout_s)
    store = store or rendezvous(host, port, rank, timeout_s)
    prefixed = dist.PrefixStore("megatron_gspo_weights", store)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    else:
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    return WeightGroup(pg, store, device)


def _buckets(named: Iterable[tuple[str, torch.Tensor]], limit: int):
    """Lists of (name, tensor) of at most `limit` bytes each (a larger tensor alone)."""
    bucket, size = [], 0
    for name, tensor in named:
        n = tensor.numel() * tensor.element_size()
        if bucket and size + n > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += n
    if bucket:
        yield bucket


def _pack(bucket: list, device: torch.device) -> tuple[list, torch.Tensor]:
    """([(name, dtype, shape, offset)], payload_N): the tensors' bytes end to end, each at an
    offset that is a multiple of 16 (a view of any dtype fits there)."""
    meta, offset = [], 0
    for name, t in bucket:
        meta.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset))
        offset += -(-t.numel() * t.element_size() // 16) * 16
    payload_N = torch.empty(offset, dtype=torch.uint8, device=device)
    for (_, t), (_, _, _, start) in zip(bucket, meta):
        n = t.numel() * t.element_size()
        payload_N[start:start + n].copy_(t.detach().contiguous().view(-1).view(torch.uint8))
    return meta, payload_N


def send_buckets(group: WeightGroup, named: Iterable[tuple[str, torch.Tensor]], version: int,
                 bucket_bytes: int) -> tuple[int, int]:
    """Rank 0: broadcast every (name, tensor) in buckets, then the end marker; returns
    (tensors, payload bytes) sent."""
    count, total, device = 0, 0, group.device
    for bucket in _buckets(named, bucket_bytes):
        meta, payload_N = _pack(bucket, device)
        header = pickle.dumps({"version": version, "tensors": meta})
        group.broadcast(torch.tensor([len(header), payload_N.numel()], device=device))
        group.broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device))
        group.broadcast(payload_N)
        count, total = count + len(bucket), total + payload_N.numel()
    group.broadcast(torch.tensor([0, count], device=device))
    return count, total


def receive_buckets(group: WeightGroup) -> Iterator[tuple[int, list]]:
    """Ranks > 0: (version, [(name, tensor), ...]) per bucket until the end marker, whose
    count is checked against the tensors received. The tensors are views of one payload."""
    received, device = 0, group.device
    while True:
        head = torch.empty(2, dtype=torch.int64, device=device)
        group.broadcast(head)
        h, n = (int(x) for x in head.tolist())
        if h == 0:
            if n != received:
                raise RuntimeError(f"weight push: the trainer sent {n} tensors, {received} "
                                   "arrived")
            return
        header_H = torch.empty(h, dtype=torch.uint8, device=device)
        group.broadcast(header_H)
        meta = pickle.loads(header_H.cpu().numpy().tobytes())
        payload_N = torch.empty(n, dtype=torch.uint8, device=device)
        group.broadcast(payload_N)
        tensors = []
        for name, dtype, shape, start in meta["tensors"]:
            dt = getattr(torch, dtype)
            size = dt.itemsize * torch.Size(shape).numel()
            tensors.append((name, payload_N[start:start + size].view(dt).view(shape)))
        received += len(tensors)
        yield meta["version"], tensors


def wait_for(condition: Callable[[], bool], timeout_s: float, every_s: float = 0.2) -> bool:
    """Poll `condition` until it holds or `timeout_s` passed; returns whether it held."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(every_s)
    return True
