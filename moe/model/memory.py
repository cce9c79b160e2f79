"""Memory of the MoE policy on one rank, from its shapes and layout: training state, a train
step's activations and logits, the Routing Replay caches, a sampler's KV cache. Plain Python
(no torch, no megatron-core): `megatron-gspo plan`, `tools/train_memory` and
`tools/replay_memory` share this one accounting.

Counts, not tensors: L layers, H hidden, Q query heads and G KV groups of D dims, E experts
(E_l on a rank), K top-k, F expert FFN width, V vocabulary (padded), `a` the activation itemsize
(2 in bf16 / fp16, 4 in fp32); TP splits heads, FFN columns of dense layers and the vocabulary,
EP the experts, sequence parallelism (SP, always on with TP > 1) the layer norms' tokens.

Training state, bytes per parameter (megatron's distributed-optimizer docs count the same):

    setting                   param  main grad  fp32 master  Adam m+v   sharded by the dist. opt.
    fp32                        4        4      - (param)       8       Adam: 8 + 8/d in all
    bf16 / fp16 + fp32 masters  2        4          4           8       masters, Adam: 6 + 12/d

Parameters come in two kinds: dense ones (attention, embeddings, output layer, router, norms),
split TP ways and replicated over the N / TP data-parallel ranks (d = N / TP for them), and
expert ones, split EP ways and replicated over the N / EP expert-data-parallel ranks (d = N / EP).

Activations: what autograd keeps for the backward, per token and layer, read off the local
layer spec (`moe.model.attention`'s SDPA, `moe.model.experts`' grouped GEMMs):

    attention  a (2 H / SP  + 4 Q_l D + 3 G_l D) + 4 Q_l     norm in, QKV in, Q/K before their
               norms, SDPA's q k v and output (+ fp32 log-sum-exp), the projection's input;
               + 8 Q_l T where the kernel materialises the [T, T] scores (CPU: fp32 scores and
               probabilities)
    MoE        (a 2 H + 4 (H + E) + a K (H + 4 F)) / SP      norm in and out, the router's fp32
               input and logits, per routed copy: the permuted input, fc1 out (2F), the gated
               activation and its prob-scaled copy (fc2's input)

Recompute (`model.recompute_granularity`) keeps less and rebuilds one layer's worth in its
backward: full keeps each layer's input (a H / SP); selective `moe` keeps the attention part and
the MoE layer's input; selective `core_attn` drops SDPA's output.

A train step's peak is then the saved layers plus the larger of two moments: the log-prob's
backward (16-bit logits: the logits and their gradient, a V-wide float32 chunk three times,
`moe.model.logprobs`; fp32 logits: three [R, V] float32 tensors) and a layer's backward (the rebuilt
part, the gradients alive at once, `BACKWARD_TEMPS` of a layer, and the experts' weights stacked
for the grouped GEMM), plus a few [tokens, H] copies of the residual stream. Checked against
measured peaks (`tests/megatron_gspo/jobs/test_plan_measured.py`): within 1% of the H100 train
steps in experiments/gpu, and 8% of a CPU step's activations (12% allowed there).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB, MIB = 1024 ** 3, 1024 ** 2
# (name, bytes/param on every rank, bytes/param the distributed optimizer shards over d ranks)
TRAINING_STATE = [("fp32", 4 + 4, 8), ("bf16 + fp32 masters", 2 + 4, 4 + 8),
                  ("bf16, no masters (old)", 2 + 4, 4)]
# per setting: bytes/param of (the weight, its fp32 main grad, the fp32 master, Adam's moments)
STATE_PARTS = {"fp32": (4, 4, 0, 8), "bf16 + fp32 masters": (2, 4, 4, 8),
               "bf16, no masters (old)": (2, 4, 0, 4)}
DTYPE_SETTING = {"fp32": "fp32", "bf16": "bf16 + fp32 masters", "fp16": "bf16 + fp32 masters"}
ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}
CHUNK_ELEMENTS = 1 << 24  # moe.model.logprobs' float32 chunk
HIDDEN_COPIES = 5  # [tokens, H] copies outside the layers: embedding out, final norm in / out,
# the output layer's input and its gradient
BACKWARD_TEMPS = 0.35
"""Gradients of a layer's activations alive at once in its backward, as a fraction of what it
saved (or rebuilt): measured on CPU, qwen3-moe-tiny bf16, 0.35-0.36 with recompute off / full."""


def bytes_per_param(setting: str, dp: int = 1, distributed: bool = False) -> float:
    """Training-state bytes per parameter (see the module docstring)."""
    kept, shardable = next((k, s) for name, k, s in TRAINING_STATE if name == setting)
    return kept + shardable / (dp if distributed else 1)


def ids_itemsize(num_experts: int) -> int:
    """Bytes of one cached expert id: uint8 up to 256 experts, int16 above (`moe.routing.replay`)."""
    return 1 if num_experts <= 256 else 2


def replay_cache_bytes(tokens: int, layers: int, topk: int, num_experts: int,
                       itemsize: int | None = None) -> int:
    """Bytes of a Routing Replay cache of `tokens` valid tokens: tokens x L x K x itemsize
    (None: the compact dtype, `ids_itemsize`)."""
    return tokens * layers * topk * (ids_itemsize(num_experts) if itemsize is None else itemsize)


@dataclass(frozen=True)
class RankParams:
    """Parameters one rank holds."""

    dense: int
    """Attention, embeddings, output layer, router, norms: replicated over the N / TP
    data-parallel ranks."""
    expert: int
    """This rank's experts: replicated over the N / EP expert-data-parallel ranks."""

    @property
    def total(self) -> int:
        return self.dense + self.expert


def params_per_rank(p, tp: int = 1, ep: int = 1) -> RankParams:
    """The parameters of `p` (a `moe.model.presets.MoEPreset`) one rank holds under TP x EP (expert
    tensor parallelism 1); sums to `p.num_params()["total"]` at TP = EP = 1."""
    h, q, g, d = p.hidden_size, p.num_attention_heads, p.num_query_groups, p.kv_channels
    split = h * d * (q + 2 * g) + q * d * h + (d * (q + 2 * g) if p.qkv_bias else 0) \
        + 3 * h * p.shared_expert_ffn_hidden_size
    whole = (2 * d if p.qk_layernorm else 0) + h * p.num_experts + 2 * h \
        + (h if p.shared_expert_gate else 0)
    emb = (1 if p.tie_word_embeddings else 2) * p.vocab_size * h
    dense = (p.num_layers * split + emb) // tp + p.num_layers * whole + h
    expert = p.num_layers * (p.num_experts // ep) * 3 * h * p.moe_ffn_hidden_size
    return RankParams(dense, expert)


def state_bytes(params: RankParams, setting: str, dp: int, edp: int,
                distributed: bool) -> dict[str, float]:
    """Bytes of one rank's training state by part (weights, grads, masters, optimizer):
    `dp` / `edp` ranks share the dense / expert masters and moments under the distributed
    optimizer."""
    weight, grad, master, adam = STATE_PARTS[setting]
    shard = (params.dense / (dp if distributed else 1)
             + params.expert / (edp if distributed else 1))
    return {"weights": weight * params.total, "grads": grad * params.total,
            "masters": master * shard, "optimizer": adam * shard}


def layer_bytes_per_token(p, itemsize: int, tp: int = 1, sp: bool = False,
                          seq_len: int = 0, fused_attention: bool = True) -> tuple[float, float]:
    """(attention, MoE) bytes one layer keeps for the backward per token of a row of `seq_len`
    positions (module docstring); `fused_attention=False` adds the [T, T] scores a CPU kernel
    materialises."""
    a, s = itemsize, (tp if sp else 1)
    h, d = p.hidden_size, p.kv_channels
    ql, gl = p.num_attention_heads / tp, p.num_query_groups / tp
    attention = a * (2 * h / s + 4 * ql * d + 3 * gl * d) + 4 * ql
    if not fused_attention:
        attention += 8 * ql * seq_len
    router = 4 * ((h if a != 4 else 0) + p.num_experts)
    shared = a * 4 * p.shared_expert_ffn_hidden_size / tp
    moe = (a * 2 * h + router + a * p.topk * (h + 4 * p.moe_ffn_hidden_size)) / s + shared
    return attention, moe


def saved_and_rebuilt(p, itemsize: int, recompute: str, modules: tuple[str, ...] = ("moe",),
                      **kw) -> tuple[float, float, float]:
    """(kept per layer, rebuilt in a layer's backward, the whole layer), bytes per token, under
    `recompute` ("off", "selective" with `modules`, "full"); `kw` as `layer_bytes_per_token`."""
    attention, moe = layer_bytes_per_token(p, itemsize, **kw)
    full, s = attention + moe, (kw.get("tp", 1) if kw.get("sp") else 1)
    layer_input = itemsize * p.hidden_size / s
    if recompute == "full":
        return layer_input, full, full
    if recompute != "selective":
        return full, 0.0, full
    rebuilt = 0.0
    if "moe" in modules:
        rebuilt += moe - 2 * layer_input  # the norm's input and output stay
    if "core_attn" in modules:
        ql = p.num_attention_heads / kw.get("tp", 1)
        rebuilt += itemsize * ql * p.kv_channels + 4 * ql \
            + (0 if kw.get("fused_attention", True) else 8 * ql * kw.get("seq_len", 0))
    return full - rebuilt, rebuilt, full


def logits_bytes(rows: int, positions: int, vocab: int, itemsize: int, grad: bool = True
                 ) -> float:
    """Bytes of the log-prob over `rows` x `positions` logits of `vocab` entries, at its
    backward (`grad`) or in a no-grad forward: 16-bit logits (and their gradient) plus three
    float32 chunks (`moe.model.logprobs`), or on the plain fp32 path three (two) float32 [rows,
    positions, vocab] tensors."""
    n = rows * positions * vocab
    if itemsize == 4:
        return (3 if grad else 2) * 4 * n
    chunk_rows = min(rows, max(1, CHUNK_ELEMENTS // max(positions * vocab, 1)))
    return (2 if grad else 1) * itemsize * n + 3 * 4 * chunk_rows * positions * vocab


def expert_stack_bytes(p, ep: int, itemsize: int) -> int:
    """One layer's expert weights stacked for the grouped GEMM (`moe.model.experts`)."""
    return (p.num_experts // ep) * 3 * p.hidden_size * p.moe_ffn_hidden_size * itemsize


@dataclass(frozen=True)
class StepMemory:
    """Bytes of a train step's activations on one rank, by part."""

    layers: float
    """What every layer keeps for the backward."""
    logits: float
    """The log-prob's backward (logits, their gradient, float32 chunks)."""
    layer_backward: float
    """One layer's backward: its rebuilt part, gradients, stacked expert weights."""
    hidden: float
    """Copies of the residual stream outside the layers."""

    @property
    def peak(self) -> float:
        return self.layers + self.hidden + max(self.logits, self.layer_backward)


def train_step_memory(p, rows: int, seq_len: int, positions: int, itemsize: int, tp: int = 1,
                      ep: int = 1, sp: bool = False, recompute: str = "off",
                      modules: tuple[str, ...] = ("moe",), fused_attention: bool = True,
                      vocab: int | None = None) -> StepMemory:
    """A forward and backward of `rows` rows of `seq_len` positions whose last `positions` go
    through the output layer (the response), on one rank of a TP x EP layout (`vocab`: the
    tokenizer's, default the preset's; TP splits it)."""
    tokens = rows * seq_len / (tp if sp else 1)
    kept, rebuilt, full = saved_and_rebuilt(p, itemsize, recompute, modules, tp=tp, sp=sp,
                                            seq_len=seq_len, fused_attention=fused_attention)
    backward = (rebuilt + BACKWARD_TEMPS * (rebuilt or full)) * tokens \
        + expert_stack_bytes(p, ep, itemsize)
    v = (p.vocab_size if vocab is None else vocab) / tp
    return StepMemory(layers=p.num_layers * kept * tokens,
                      logits=logits_bytes(rows, positions, v, itemsize),
                      layer_backward=backward,
                      hidden=HIDDEN_COPIES * itemsize * p.hidden_size * tokens)


def forward_memory(p, rows: int, seq_len: int, positions: int, itemsize: int, tp: int = 1,
                   ep: int = 1, sp: bool = False, vocab: int | None = None) -> float:
    """A no-grad forward (the pi_old pass): one layer's activations at a time (an upper bound),
    the logits and three float32 chunks of their log-softmax, the residual stream."""
    tokens = rows * seq_len / (tp if sp else 1)
    attention, moe = layer_bytes_per_token(p, itemsize, tp=tp, sp=sp, seq_len=seq_len)
    v = (p.vocab_size if vocab is None else vocab) / tp
    return (attention + moe) * tokens + logits_bytes(rows, positions, v, itemsize, grad=False) \
        + HIDDEN_COPIES * itemsize * p.hidden_size * tokens + expert_stack_bytes(p, ep, itemsize)


def kv_cache_bytes(p, rows: int, max_len: int, itemsize: int, tp: int = 1) -> int:
    """A KV-cache sampler's keys and values: rows x max_len x L x 2 x G_l x D x itemsize."""
    return int(rows * max_len * p.num_layers * 2 * (p.num_query_groups // tp)
               * p.kv_channels * itemsize)
