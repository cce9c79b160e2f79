"""The MoE policy: a megatron-core GPTModel in megatron DDP with megatron's optimizer.

Shape legend: B sequences, T tokens per sequence, S the columns a call returns (a KV-cache
step's new columns; the positions from `first` / `start` on, which are all the output layer
projects), V vocab.

Sequences are left-padded prompts followed by responses and right padding; `valid_BT` marks the
real tokens. The attention mask is causal and hides padding keys; position ids count real tokens
only, so a left-padded prompt sees the same positions as an unpadded one. Under sequence
parallel T is padded up to a multiple of tp. Packed (`MoEPolicy.pack`, `moe.model.packed`): the
rows' real tokens run as one sequence instead, positions restarting and attention confined to
each row, padded to a multiple of tp once; the outputs are scattered back into [B, T]. Logits beyond the tokenizer's vocabulary (the preset
vocab is padded) are masked to -inf, so they are never sampled and carry no probability.
The samplers' KV-cache decoders (`moe.inference.decode`) and megatron's dynamic engine (`moe.inference.engine`)
run the same model.

This is the RL package's only door into megatron: `megatron_gspo` calls these methods and never
imports megatron.core itself.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                       finalize_model_grads)
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

from moe.model.attention import attention_inputs
from moe.platform.compat import apply_cpu_patches
from moe.model.logprobs import chunked_token_logprobs
from moe.model.gpt import build_gpt_moe, have_transformer_engine
from moe.model.optim import PolicyOptimizer
from moe.model.packed import Pack
from moe.model.presets import MoEPreset
from moe.routing.replay import replay_backward
from moe.routing.tokens import RouterRows
from moe.model.settings import OptimSettings, ParallelLayout, Recompute


class MoEPolicy:
    """Policy model + optimizer. Build with `MoEPolicy.build(...)` after `init_parallel`."""

    def __init__(self, model, optimizer: PolicyOptimizer | None, preset: MoEPreset,
                 layout: ParallelLayout, real_vocab: int, device: torch.device,
                 recompute: Recompute = Recompute(), pack: bool = False):
        self.model, self.optimizer = model, optimizer
        self.pack = pack
        """Forward a batch's rows packed (`moe.model.packed`: their real tokens as one
        sequence) instead of padded to the batch's width; the same numbers to float rounding.
        Routing caches recorded and replayed follow it (`router_rows`)."""
        self.version = 0
        """Counts weight changes (optimizer steps taken, `weights_changed` calls): a sampler
        holding its own copy of the weights pushes when this moved."""
        self.preset, self.layout = preset, layout
        self.real_vocab, self.device, self.recompute = real_vocab, device, recompute
        # per replayed forward, the routing its recompute must replay (`moe.routing.replay`)
        self.backward_replays: list[list[torch.Tensor]] = []
        self.router_replays = model.module.router_replays if hasattr(model, "module") \
            else model.router_replays

    @classmethod
    def build(cls, preset: MoEPreset, layout: ParallelLayout, *, real_vocab: int, seed: int = 0,
              dtype: torch.dtype = torch.float32, aux_loss_coeff: float = 0.0,
              optim: OptimSettings | None = OptimSettings(),
              recompute: Recompute = Recompute(),
              sdpa_attention: bool = True, pack: bool = False,
              inference_graphs: bool = False, **model_kwargs) -> "MoEPolicy":
        """The GPTModel wrapped in megatron DDP, with megatron's Adam (`moe.model.optim`; None: no
        optimizer). 16-bit `dtype` trains with fp32 main grads and fp32 master weights.
        `sdpa_attention`: core attention as `moe.model.attention.SDPAAttention` (local spec);
        `pack`: packed forwards (`MoEPolicy.pack`; the local spec needs `sdpa_attention`);
        `inference_graphs`: CUDA graphs for megatron's dynamic engine (`moe.inference.engine`);
        `model_kwargs`: more of `moe.model.gpt.build_gpt_moe`'s (`experts`)."""
        apply_cpu_patches()
        if pack and not sdpa_attention and not have_transformer_engine():
            raise ValueError("packed forwards need SDPAAttention (sdpa_attention=True): "
                             "megatron's DotProductAttention has no packed path")
        if pack:
            packable(layout)
        if real_vocab > preset.vocab_size:
            raise ValueError(f"tokenizer vocab {real_vocab} exceeds preset {preset.name!r} "
                             f"vocab_size={preset.vocab_size}")
        gpt = build_gpt_moe(preset, layout, seed=seed, dtype=dtype, aux_loss_coeff=aux_loss_coeff,
                            sdpa_attention=sdpa_attention, recompute=recompute,
                            inference_graphs=inference_graphs, **model_kwargs)
        model = DistributedDataParallel(gpt.config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, bucket_size=None,
            use_distributed_optimizer=optim is not None and optim.distributed), gpt)
        optimizer = None if optim is None else PolicyOptimizer(model, optim)
        device = next(gpt.parameters()).device
        return cls(model, optimizer, preset, layout, real_vocab, device, recompute, pack)

    # ---------------------------------------------------------------- forward
    def _pad_for_sp(self, *tensors_BT):
        tp = self.layout.tp if self.layout.sequence_parallel else 1
        pad = (-tensors_BT[0].shape[1]) % tp
        if pad == 0:
            return tensors_BT, 0
        return tuple(F.pad(t, (0, pad)) for t in tensors_BT), pad

    def logits(self, tokens_BT: torch.Tensor, valid_BT: torch.Tensor,
               first: int = 0) -> torch.Tensor:
        """Float32 logits [B, T - first, V] for next-token prediction at positions first..T-1
        (the output layer runs on those positions only; `_raw_logits`). Packed (`pack`): zeros
        at padding positions."""
        return self.mask_vocab(self._raw_logits(tokens_BT, valid_BT, first).float())

    def _check_batch(self, tokens_BT: torch.Tensor, valid_BT: torch.Tensor, first: int) -> None:
        if tokens_BT.shape != valid_BT.shape or tokens_BT.dim() != 2:
            raise ValueError(f"tokens {tuple(tokens_BT.shape)} and valid "
                             f"{tuple(valid_BT.shape)} must be equal [B, T] shapes")
        T = tokens_BT.shape[1]
        if T > self.preset.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds preset max_seq_len="
                             f"{self.preset.max_seq_len}")
        if not 0 <= first < T:
            raise ValueError(f"first={first}: expected a position in [0, {T})")

    def _raw_logits(self, tokens_BT: torch.Tensor, valid_BT: torch.Tensor,
                    first: int) -> torch.Tensor:
        """The model's logits [B, T - first, V_preset] in its dtype, vocab padding unmasked.
        The whole sequence runs through the decoder; with `first` > 0 the output layer projects
        only positions first..T-1 (a pre-hook slices its [T, B, H] input; `_output_rows`).
        Packed: the positions of real tokens only, zeros elsewhere (`_packed_logits`)."""
        self._check_batch(tokens_BT, valid_BT, first)
        if self.pack:
            pack = Pack.of(valid_BT.to(self.device), self._sp_multiple)
            pos_P, flat_P = pack.positions_at(first)
            return pack.scatter(self._packed_logits(tokens_BT, pack, pos_P), flat_P, first)
        T = tokens_BT.shape[1]
        (tokens_BT, valid_BT), _ = self._pad_for_sp(tokens_BT.to(self.device),
                                                    valid_BT.to(self.device))
        position_ids_BT, mask_B1TT = attention_inputs(valid_BT)
        with self._output_rows(slice(first, None) if first else None) as sliced:
            logits_BSV = self.model(tokens_BT, position_ids_BT, mask_B1TT)
        return logits_BSV[:, :T - first] if sliced else logits_BSV[:, first:T]

    @property
    def _sp_multiple(self) -> int:
        return self.layout.tp if self.layout.sequence_parallel else 1

    def _packed_logits(self, tokens_BT: torch.Tensor, pack: Pack,
                       rows_P: torch.Tensor) -> torch.Tensor:
        """Logits [P, V_preset] of the packed positions `rows_P` of one packed forward of the
        batch (`moe.model.packed`: megatron's `thd` format, the output layer on those rows
        only)."""
        packable(self.layout)
        cu = pack.cu_seqlens()
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu.to(self.device),
                                 cu_seqlens_kv=cu.to(self.device),
                                 max_seqlen_q=int(cu.diff().max()),
                                 max_seqlen_kv=int(cu.diff().max()))
        with self._output_rows(rows_P.to(self.device)):
            logits_1PV = self.model(pack.tokens(tokens_BT.to(self.device)), pack.positions(),
                                    None, packed_seq_params=params)
        return logits_1PV[0]

    @contextlib.contextmanager
    def _output_rows(self, rows):
        """Within: the output layer sees only the sequence rows `rows` (a slice or an index
        tensor of positions; None: all of them); yields whether it is restricted.

        Under sequence parallelism its input is this rank's sequence shard, which megatron's
        layer all-gathers inside its matmul (reduce-scattering the input grad in the backward).
        Here the pre-hook does that all-gather itself, selects, and the layer runs for this
        call as a plain column-parallel projection with no input-grad reduction of its own:
        the gather's reduce-scatter sums the TP ranks' partial input grads, as before. (megatron's
        `GPTModel` does the same gather-then-project for the last token's logits in dynamic-batch
        inference, where no grad flows.)"""
        if rows is None:
            yield False
            return
        gpt = self.model
        while not hasattr(gpt, "output_layer"):  # DDP (and Float16Module) wrappers
            gpt = gpt.module
        layer, sp = gpt.output_layer, self.layout.sequence_parallel

        def select(module, args, kwargs):
            x_TBH = args[0] if args else kwargs["input_"]
            if sp:
                x_TBH = gather_from_sequence_parallel_region(x_TBH, group=layer.tp_group)
            if args:
                return (x_TBH[rows], *args[1:]), kwargs
            return args, {**kwargs, "input_": x_TBH[rows]}

        flags = {"sequence_parallel": False, "allreduce_dgrad": False,
                 "disable_grad_reduce": True} if sp else {}
        saved = {k: getattr(layer, k) for k in flags}
        handle = layer.register_forward_pre_hook(select, with_kwargs=True)
        try:
            for k, v in flags.items():
                setattr(layer, k, v)
            yield True
        finally:
            handle.remove()
            for k, v in saved.items():
                setattr(layer, k, v)

    def mask_vocab(self, logits_BxV: torch.Tensor) -> torch.Tensor:
        """-inf on the preset's padding entries beyond the tokenizer's vocabulary."""
        if self.real_vocab >= logits_BxV.shape[-1]:
            return logits_BxV
        return logits_BxV.masked_fill(
            torch.arange(logits_BxV.shape[-1], device=logits_BxV.device) >= self.real_vocab,
            float("-inf"))

    def token_logprobs(self, tokens_BT: torch.Tensor, valid_BT: torch.Tensor,
                       temperature: float = 1.0, with_entropy: bool = False, start: int = 1):
        """log pi(tokens[t] | tokens[<t]) at each position t >= start ([B, T]; columns before
        `start` are 0). Only positions start-1..T-2 go through the output layer and the
        log-softmax (the loss needs the response: pass its first column), over the tokenizer's
        vocabulary (the preset's padding entries are left out, not masked), in float32 over
        chunks of tokens without a float32 copy of the logits (`moe.model.logprobs`). Packed
        (`pack`): only the real tokens from `start` on that follow a real token of their row;
        0 elsewhere (padding included).

        With `with_entropy`, also the entropy of the predictive distribution at each position
        (a metric: computed without grad, from the same chunks).
        """
        T = tokens_BT.shape[-1]
        if not 1 <= start < T:
            raise ValueError(f"start={start}: expected a position in [1, {T})")
        if self.pack:
            return self._packed_logprobs(tokens_BT, valid_BT, temperature, with_entropy, start)
        logits_BSV = self._raw_logits(tokens_BT, valid_BT, start - 1)[:, :-1]
        out = chunked_token_logprobs(logits_BSV, tokens_BT[:, start:], self.real_vocab,
                                     temperature, with_entropy)
        return tuple(F.pad(t, (start, 0)) for t in out) if with_entropy \
            else F.pad(out, (start, 0))

    def _packed_logprobs(self, tokens_BT, valid_BT, temperature, with_entropy, start):
        """`token_logprobs` of one packed forward, scattered back into the rows."""
        self._check_batch(tokens_BT, valid_BT, start - 1)
        tokens_BT = tokens_BT.to(self.device)
        pack = Pack.of(valid_BT.to(self.device), self._sp_multiple)
        pred_P, target_P = pack.predictions(start)
        logits_1PV = self._packed_logits(tokens_BT, pack, pred_P)[None]
        out = chunked_token_logprobs(logits_1PV, tokens_BT.reshape(-1)[target_P][None],
                                     self.real_vocab, temperature, with_entropy)
        if with_entropy:
            return tuple(pack.scatter(t[0], target_P) for t in out)
        return pack.scatter(out[0], target_P)

    def positions(self, valid_BT: torch.Tensor) -> int:
        """Positions a forward of these rows runs: B x T (T padded to a multiple of TP under
        sequence parallelism) padded, the real tokens and the pack's alignment packed."""
        if self.pack:
            return Pack.of(valid_BT, self._sp_multiple).length
        B, T = valid_BT.shape
        return B * (T + (-T) % self._sp_multiple)

    @property
    def router_rows(self) -> RouterRows:
        """The order this policy's forwards show their tokens to the routers
        (`moe.routing.tokens`): what its routing caches are recorded and replayed in."""
        sp = self.layout.sequence_parallel
        return RouterRows(packed=self.pack, shards=self._sp_multiple,
                          shard=ps.get_tensor_model_parallel_rank() if sp else 0,
                          group=ps.get_tensor_model_parallel_group() if sp and self.pack
                          else None)

    def routed_valid(self, valid_BT: torch.Tensor) -> torch.Tensor:
        """The part of `valid_BT` this rank's routing caches hold: its sequence shard under
        padded SP, else all of it (`RouterRows.routed_valid`)."""
        return self.router_rows.routed_valid(valid_BT)

    # ---------------------------------------------------------------- training
    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    def zero_grad(self) -> None:
        self.backward_replays.clear()
        self.model.zero_grad_buffer()
        if self.optimizer is not None:
            self.optimizer.zero_grad()

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`, times the fp16 loss scale when there is one. Under activation
        recompute, routers re-run in the backward replay what the forward replayed."""
        replays, self.backward_replays = self.backward_replays, []
        with replay_backward(self, replays):
            (loss if self.optimizer is None else self.optimizer.scale_loss(loss)).backward()

    def step(self) -> tuple[bool, float]:
        """Reduce grads (megatron's finalize), then megatron's optimizer: clip to `grad_clip`,
        Adam on the fp32 (master) weights. Returns (stepped, grad_norm).

        A non-finite grad norm (identical on every rank) skips the update on every rank.
        """
        finalize_model_grads([self.model])
        stepped, grad_norm = self.optimizer.step()
        self.version += int(stepped)
        return stepped, grad_norm

    def weights_changed(self) -> None:
        """Call after writing the model's weights outside the optimizer (init checkpoint, HF
        import): 16-bit models' fp32 master copies are refreshed from them (megatron's
        `reload_model_params`)."""
        self.version += 1
        if self.optimizer is not None:
            self.optimizer.optimizer.reload_model_params()

    @property
    def lr(self) -> float:
        """The learning rate of the latest update (of the next one before any update)."""
        return self.optimizer.last_lr


def packable(layout: ParallelLayout) -> None:
    """ValueError for a layout packed forwards cannot run under: megatron's all-gather token
    dispatcher across expert-parallel ranks gathers equal token counts from every rank, and the
    packs of different data-parallel rows differ in length (the all-to-all dispatcher takes any
    counts)."""
    if layout.ep > 1 and layout.dispatcher == "allgather":
        raise ValueError(f"packed forwards with ep={layout.ep} need the all-to-all token "
                         "dispatcher (dispatcher='alltoall' or 'auto'), not 'allgather', which "
                         "gathers equal token counts from every expert-parallel rank")
