"""`moe.experts.GroupedSequentialMLP` (grouped-GEMM experts) equals megatron's `SequentialMLP`.

The reference is the same model with its experts' class set back to megatron's `SequentialMLP`
(same modules and parameters; only `forward` differs), so logits and grads compare one to one.
"""

import pytest
import torch
from megatron.core.transformer.moe.experts import SequentialMLP

from moe.experts import GroupedSequentialMLP, grouped_mm_runs
from tests.moe import parallel_worker as pw

TIMEOUT_S = 600
# cuBLAS's grouped kernel may order the K-reduction differently from its per-expert mm (CPU:
# the same GEMMs, so fp32 to rounding and bf16 bitwise); on CUDA fp32 compares to 1e-5, bf16 to
# a few bf16 ulps.
CUDA_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def tol(policy, dtype, cpu: dict) -> dict:
    return CUDA_TOL[dtype] if policy.device.type == "cuda" else cpu


def expert_modules(policy) -> list:
    return [m for m in policy.model.module.modules() if isinstance(m, SequentialMLP)]


def as_sequential(policy) -> None:
    for m in expert_modules(policy):
        m.__class__ = SequentialMLP


def build(preset_name: str, seed: int = 3, dtype=torch.float32, layout=None, **kwargs):
    from moe.policy import MoEPolicy
    from moe.presets import get_preset
    from moe.settings import ParallelLayout

    preset = get_preset(preset_name)
    return MoEPolicy.build(preset, layout or ParallelLayout(), real_vocab=preset.vocab_size,
                           seed=seed, optim=None, dtype=dtype, **kwargs)


def grads(policy) -> dict:
    """The reduced grads (copies: the next `zero_grad` zeroes the buffers)."""
    return {n: p.main_grad.clone() for n, p in policy.model.module.named_parameters()}


@pytest.mark.parametrize("preset_name", ["tiny", "qwen3-moe-tiny"])
def test_grouped_experts_match_sequential_mlp(single_process, preset_name, monkeypatch):
    policy = build(preset_name)
    assert expert_modules(policy) and all(type(m) is GroupedSequentialMLP
                                          for m in expert_modules(policy))
    assert grouped_mm_runs(policy.device.type, torch.float32)  # probed before counting calls
    calls = []
    grouped_mm = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or
                        grouped_mm(*a, **k))
    tokens_BT, valid_BT, readout_BTV = pw.batch(policy.preset.vocab_size, B=6, T=16)
    logits, norm = pw.run_model(policy, tokens_BT, valid_BT, readout_BTV)
    got = grads(policy)
    # per layer fc1 + fc2 forward, and each one's input grad and weight grad (`GroupedLinear`)
    assert len(calls) == 6 * policy.preset.num_layers  # the batched path ran
    as_sequential(policy)
    ref_logits, ref_norm = pw.run_model(policy, tokens_BT, valid_BT, readout_BTV)
    assert len(calls) == 6 * policy.preset.num_layers  # the reference did not use it
    torch.testing.assert_close(logits, ref_logits, **tol(policy, torch.float32,
                                                         dict(atol=1e-6, rtol=1e-5)))
    for name, g in grads(policy).items():
        torch.testing.assert_close(got[name], g, **tol(policy, torch.float32,
                                                       dict(atol=1e-7, rtol=1e-5)),
                                   msg=lambda m: f"{name}: {m}")
    expert_grads = [n for n, g in got.items() if ".experts." in n and g.abs().sum() > 0]
    assert len(expert_grads) >= policy.preset.num_experts  # routed experts received grads
    assert abs(norm - ref_norm) <= tol(policy, torch.float32, dict(rtol=1e-6))["rtol"] * ref_norm


def test_grouped_experts_bf16_match_sequential_mlp(single_process):
    policy = build("tiny", dtype=torch.bfloat16)
    tokens_BT, valid_BT, readout_BTV = pw.batch(policy.preset.vocab_size)

    def run():  # bf16: the fp32 main grads as DDP's hooks accumulate them
        policy.zero_grad()
        logits = policy.logits(tokens_BT, valid_BT)
        pw.loss_fn(logits, valid_BT, readout_BTV).backward()
        return logits.detach(), {n: p.main_grad.clone()
                                 for n, p in policy.model.module.named_parameters()}

    logits, got = run()
    as_sequential(policy)
    ref_logits, ref = run()
    torch.testing.assert_close(logits, ref_logits,  # CPU: same bf16 GEMMs, same order
                               **tol(policy, torch.bfloat16, dict(atol=0, rtol=0)))
    for name, g in ref.items():
        torch.testing.assert_close(got[name], g, **tol(policy, torch.bfloat16,
                                                       dict(atol=1e-6, rtol=1e-3)),
                                   msg=lambda m: f"{name}: {m}")


def test_unsupported_shapes_fall_back_to_the_loop(single_process):
    policy = build("tiny")
    experts = expert_modules(policy)[0]
    x_NH = torch.randn(5, policy.preset.hidden_size)
    assert experts._grouped_ok(x_NH)
    assert not experts._grouped_ok(torch.randn(5, 30))  # 120-byte rows: _grouped_mm rejects
    assert not experts._grouped_ok(x_NH.double())


@pytest.mark.parametrize("mode", [torch.inference_mode, torch.no_grad])
def test_grouped_mm_probe_answers_the_same_under_no_grad(single_process, mode):
    """The first expert call of a run is the sampler's, under inference mode: the probe's
    backward must not fail there (it did, and cached False: the trainer's experts all ran
    megatron's loop)."""
    grouped_mm_runs.cache_clear()
    try:
        with mode():
            assert grouped_mm_runs("cpu", torch.float32)
    finally:
        grouped_mm_runs.cache_clear()


def test_grouped_mm_probe_errors_that_are_not_about_kernels(single_process, monkeypatch):
    """No CUDA in this torch, or no kernel image for this GPU: "no". Out of memory or a broken
    CUDA context: raised, not cached as "no kernel" (the rest of the run would take the loop)."""
    import moe.experts as experts

    grouped_mm_runs.cache_clear()
    try:
        if not torch.cuda.is_available():
            assert not grouped_mm_runs("cuda", torch.float32)
        for error in (torch.OutOfMemoryError("probe"), RuntimeError("CUDA error: launch failure")):
            def fail(*a, error=error):
                raise error
            monkeypatch.setattr(experts, "_probe_grouped_mm", fail)
            with pytest.raises(type(error)):
                grouped_mm_runs("cpu", torch.float32)
        monkeypatch.setattr(experts, "_probe_grouped_mm", lambda *a: (_ for _ in ()).throw(
            RuntimeError("CUDA error: no kernel image is available for execution on the device")))
        assert not grouped_mm_runs("cpu", torch.float32)  # an arch without the kernel: "no"
        grouped_mm_runs.cache_clear()
        monkeypatch.undo()
        assert grouped_mm_runs("cpu", torch.float32)  # the errors were not cached
    finally:
        grouped_mm_runs.cache_clear()


def test_the_trainer_runs_the_grouped_experts(tmp_path, monkeypatch):
    """End to end: one iteration (rollout, pi_old's pass, optimizer steps) runs every MoE layer
    grouped: `GroupedLinear` in the optimizer steps, stacked weights in the no-grad passes and
    the sampler (the probe's cache starts empty, so the sampler probes under inference mode)."""
    from moe.experts import GroupedLinear
    from tests.megatron_gspo.jobs.trainers import make_trainer

    grouped_mm_runs.cache_clear()
    trained, stacked = [], []
    apply, stack = GroupedLinear.apply, GroupedSequentialMLP.stacked_weights
    monkeypatch.setattr(GroupedLinear, "apply", lambda *a: trained.append(1) or apply(*a))
    monkeypatch.setattr(GroupedSequentialMLP, "stacked_weights",
                        lambda self: stacked.append(1) or stack(self))
    loops, loop = [], SequentialMLP.forward
    monkeypatch.setattr(SequentialMLP, "forward", lambda *a, **k: loops.append(1) or loop(*a, **k))
    try:
        trainer = make_trainer(tmp_path)
        trainer.iteration()
    finally:
        grouped_mm_runs.cache_clear()
    assert not loops, "megatron's per-expert loop ran"
    assert trained and stacked


def test_a_device_without_grouped_mm_kernels_falls_back(single_process, monkeypatch):
    """Where `_grouped_mm` has no kernel (CUDA before sm90, fp32 on some torch builds) the probe
    says so once and the experts run megatron's loop, with the same logits."""
    policy = build("tiny")
    tokens_BT, valid_BT, _ = pw.batch(policy.preset.vocab_size)
    with torch.no_grad():
        want = policy.logits(tokens_BT, valid_BT)

    def no_kernel(*a, **k):
        raise RuntimeError("grouped gemm is not supported on this device")

    monkeypatch.setattr(torch, "_grouped_mm", no_kernel)
    grouped_mm_runs.cache_clear()
    try:
        assert not grouped_mm_runs(policy.device.type, torch.float32)
        assert not expert_modules(policy)[0]._grouped_ok(
            torch.randn(5, policy.preset.hidden_size, device=policy.device))
        with torch.no_grad():
            got = policy.logits(tokens_BT, valid_BT)  # no_kernel would raise if called
    finally:
        grouped_mm_runs.cache_clear()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.fixture(scope="module")
def sequential_reference(single_process, tmp_path_factory):
    """test_parallel's 1-process reference, computed with megatron's SequentialMLP experts."""
    from tests.moe.test_parallel import single_process_reference

    policy = build("tiny")
    as_sequential(policy)
    ref = single_process_reference(policy)
    path = tmp_path_factory.mktemp("experts") / "ref.pt"
    torch.save(ref, path)
    return str(path)


@pytest.mark.slow
def test_grouped_experts_under_ep2_match_sequential_single_process(sequential_reference):
    """EP=2 on 2 gloo processes (4 local experts per rank, both dispatchers): the grouped
    experts' logits, gathered grads, replay and KV decode equal the 1-process SequentialMLP."""
    layouts = [(1, 2, False, "alltoall"), (1, 2, False, "allgather")]
    pw.spawn(pw.worker, (2, pw.free_port(), sequential_reference, layouts), nprocs=2,
             timeout_s=TIMEOUT_S)


def test_training_forward_keeps_no_stacked_copy_of_the_expert_weights(single_process):
    """What the experts' forward saves for the backward, beyond the parameters themselves: with
    `GroupedLinear` no E x H x F stack (autograd through `torch.stack` kept one per GEMM); the
    grads are the same as the stack-and-autograd path's."""
    policy = build("qwen3-moe-tiny")
    experts = expert_modules(policy)[0]
    experts.grads_into_main_grad = False  # weight grads through autograd, for autograd.grad
    param_ptrs = {p.untyped_storage().data_ptr() for p in policy.model.module.parameters()}
    stack_bytes = sum(e.linear_fc1.weight.nbytes + e.linear_fc2.weight.nbytes
                      for e in experts.local_experts)
    g = torch.Generator().manual_seed(0)
    E, H, device = experts.num_local_experts, policy.preset.hidden_size, policy.device
    counts = torch.full((E,), 3, dtype=torch.int64, device=device)
    x = torch.randn(3 * E, H, generator=g).to(device).requires_grad_()  # where the weights are
    probs = torch.rand(3 * E, generator=g).to(device)

    def saved_bytes(fn):
        seen = {}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in param_ptrs:
                seen[ptr] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn()
        return sum(seen.values()), out

    def stacked_path():  # the autograd-through-stack forward this class replaced
        w1, w2 = experts.stacked_weights()
        offs = counts.cumsum(0).to(torch.int32)
        h = experts._activation(torch._grouped_mm(x, w1, offs=offs), probs)
        h.register_hook(lambda g: g.contiguous())  # its CPU backward rejects stride-0 grads
        return torch._grouped_mm(h, w2, offs=offs)

    assert experts._grouped_ok(x)  # the probe runs (and saves its own tensors) before measuring
    new_bytes, out = saved_bytes(lambda: experts(x, counts, probs)[0])
    old_bytes, ref = saved_bytes(stacked_path)
    assert old_bytes - new_bytes == stack_bytes  # both stacks no longer saved, nothing else new
    readout = torch.randn(out.shape, generator=g).to(device)
    got = torch.autograd.grad((out * readout).sum(), [x, *experts.parameters()])
    want = torch.autograd.grad((ref * readout).sum(), [x, *experts.parameters()])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_grads_go_into_main_grad_without_ddp_hooks(single_process, dtype):
    """Under DDP the backward adds the expert weight grads into `main_grad` itself: no autograd
    accumulation (and so no DDP hook) per expert weight; the same sums as through DDP's hooks."""
    policy = build("qwen3-moe-tiny", dtype=dtype)
    experts = expert_modules(policy)
    assert experts and all(m.grads_into_main_grad for m in experts)  # set by MoEPolicy.build
    weights = [p for m in experts for p in m.parameters()]
    accumulated = []
    for p in weights:
        p.register_post_accumulate_grad_hook(lambda p: accumulated.append(p))
    tokens_BT, valid_BT, readout_BTV = pw.batch(policy.preset.vocab_size, B=6, T=16)

    def run():
        policy.zero_grad()
        pw.loss_fn(policy.logits(tokens_BT, valid_BT), valid_BT, readout_BTV).backward()
        return grads(policy)

    direct = run()
    assert not accumulated
    for m in experts:
        m.grads_into_main_grad = False
    hooked = run()
    assert len(accumulated) == len(weights)  # DDP's path: every expert weight accumulated
    assert sum(bool(direct[n].any()) for n in direct if ".experts." in n) >= len(weights) // 2
    # bitwise on CPU; on CUDA the two backward passes differ by the order of the dispatch's
    # atomic adds (megatron's scatter-add unpermute, index_select's backward): to its rounding
    for name, g in hooked.items():
        if policy.device.type == "cpu":
            assert torch.equal(direct[name], g), name
        else:
            torch.testing.assert_close(direct[name], g, **CUDA_TOL[dtype], msg=name)


def test_frozen_expert_weights_get_no_grad_through_main_grad(single_process):
    """Experts frozen after the build take the autograd path (no grads for frozen weights);
    the direct main_grad path is only for weights that train."""
    policy = build("qwen3-moe-tiny")
    frozen = expert_modules(policy)[0]
    for p in frozen.parameters():
        p.requires_grad_(False)
    tokens_BT, valid_BT, readout_BTV = pw.batch(policy.preset.vocab_size, B=6, T=16)
    policy.zero_grad()
    pw.loss_fn(policy.logits(tokens_BT, valid_BT), valid_BT, readout_BTV).backward()
    assert not any(p.main_grad.any() for p in frozen.parameters())
    trained = expert_modules(policy)[1]
    assert any(p.main_grad.any() for p in trained.parameters())


def test_expert_weight_changed_in_place_before_the_backward_raises(single_process):
    """The direct main_grad path saves no autograd references to the weights, so it checks their
    versions itself, as autograd does for saved tensors: a weight written in place between the
    forward and the backward (the grads would belong to other weights) is an error."""
    policy = build("qwen3-moe-tiny")
    tokens_BT, valid_BT, readout_BTV = pw.batch(policy.preset.vocab_size, B=6, T=16)
    policy.zero_grad()
    loss = pw.loss_fn(policy.logits(tokens_BT, valid_BT), valid_BT, readout_BTV)
    with torch.no_grad():
        expert_modules(policy)[0].local_experts[1].linear_fc2.weight.mul_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
