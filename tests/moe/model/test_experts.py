"""`moe.model.experts.StackedExperts` (stacked expert weights, grouped GEMMs) equals megatron's
per-expert `SequentialMLP`.

The reference is the same preset built with megatron's `SequentialMLP` experts
(`build_gpt_moe(experts=SequentialMLP)`: one module and two parameters per expert, the layout
before the stacked one); the same seed draws the same weights into both, so logits, grads and
optimizer updates compare one to one (`as_stacked` puts the reference's per-expert tensors in
the stacked layout).
"""

import re

import pytest
import torch
from megatron.core.transformer.moe.experts import SequentialMLP

from moe.model.experts import ExpertMM, StackedExperts, grouped_mm_runs
from tests.moe import parallel_worker as pw

TIMEOUT_S = 600
# cuBLAS's grouped kernel may order the K-reduction differently from its per-expert mm (CPU:
# the same GEMMs, so fp32 to rounding and bf16 bitwise); on CUDA fp32 compares to 1e-5, bf16 to
# a few bf16 ulps.
CUDA_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12]\.weight)$")


def tol(policy, dtype, cpu: dict) -> dict:
    return CUDA_TOL[dtype] if policy.device.type == "cuda" else cpu


def expert_modules(policy) -> list:
    return [m for m in policy.model.module.modules()
            if isinstance(m, (StackedExperts, SequentialMLP))]


def build(preset_name: str, seed: int = 3, dtype=torch.float32, layout=None, **kwargs):
    from moe.model.policy import MoEPolicy
    from moe.model.presets import get_preset
    from moe.model.settings import ParallelLayout

    preset = get_preset(preset_name)
    kwargs.setdefault("optim", None)
    return MoEPolicy.build(preset, layout or ParallelLayout(), real_vocab=preset.vocab_size,
                           seed=seed, dtype=dtype, **kwargs)


def as_stacked(tensors: dict) -> dict:
    """A per-expert (`SequentialMLP`) name -> tensor dict in the stacked layout: each layer's
    `local_experts.{e}.linear_fcX.weight` stacked over e into `experts.linear_fcX.weight`."""
    out, stacks = {}, {}
    for name, t in tensors.items():
        if m := _PER_EXPERT.match(name):
            stacks.setdefault(m.group(1) + m.group(3), {})[int(m.group(2))] = t
        else:
            out[name] = t
    for name, rows in stacks.items():
        out[name] = torch.stack([rows[e] for e in range(len(rows))])
    return out


def grads(policy) -> dict:
    """The reduced grads (copies: the next `zero_grad` zeroes the buffers)."""
    return {n: p.main_grad.clone() for n, p in policy.model.module.named_parameters()}


def params(policy) -> dict:
    return {n: p.detach().clone() for n, p in policy.model.module.named_parameters()}


def test_the_moe_layer_holds_two_expert_parameters_whatever_the_expert_count(single_process):
    """The tiny preset's MoE layer: fc1 and fc2 of every expert in one parameter each
    ([E, 2F, H] and [E, H, F]), at 8 experts and at 64."""
    import dataclasses

    from moe.model.gpt import build_gpt_moe
    from moe.model.presets import get_preset

    tiny = get_preset("tiny")
    for E in (tiny.num_experts, 64):
        preset = dataclasses.replace(tiny, num_experts=E)
        mlp = build_gpt_moe(preset).decoder.layers[0].mlp
        shapes = [tuple(p.shape) for p in mlp.experts.parameters()]
        F, H = preset.moe_ffn_hidden_size, preset.hidden_size
        assert shapes == [(E, 2 * F, H), (E, H, F)], E


@pytest.mark.parametrize("preset_name", ["tiny", "qwen3-moe-tiny"])
def test_a_train_step_equals_the_per_expert_layout(single_process, preset_name):
    """fp32, one optimizer step (megatron's Adam, grad clipping): the loss, every reduced grad,
    the grad norm and every updated weight equal those of megatron's per-expert `SequentialMLP`
    built with the same seed (its weights stacked for the comparison); the same initial
    weights too. CPU: bitwise today; compared to fp32 rounding."""
    from moe.model.settings import OptimSettings

    def step(**kwargs):
        policy = build(preset_name, optim=OptimSettings(lr=1e-2), **kwargs)
        start = params(policy)
        tokens_BT, valid_BT, readout_BTV = pw.batch(policy.preset.vocab_size, B=6, T=16)
        policy.zero_grad()
        loss = pw.loss_fn(policy.logits(tokens_BT, valid_BT), valid_BT, readout_BTV)
        policy.backward(loss)
        reduced = grads(policy)
        stepped, norm = policy.step()
        assert stepped
        return loss.item(), norm, start, reduced, params(policy)

    loss, norm, start, got_grads, updated = step()
    assert {type(m) for m in expert_modules(build(preset_name))} == {StackedExperts}
    ref_loss, ref_norm, *ref = step(experts=SequentialMLP)
    ref_start, ref_grads, ref_updated = (as_stacked(d) for d in ref)
    assert loss == pytest.approx(ref_loss, rel=1e-6, abs=1e-9)
    assert norm == pytest.approx(ref_norm, rel=1e-6)
    for got, want in ((start, ref_start), (got_grads, ref_grads), (updated, ref_updated)):
        assert got.keys() == want.keys()
        for name in got:
            torch.testing.assert_close(got[name], want[name], atol=1e-7, rtol=1e-5,
                                       msg=lambda m: f"{name}: {m}")
    routed = [n for n, g in got_grads.items() if ".experts." in n]
    assert all(bool((got_grads[n].flatten(1).abs().sum(1) > 0).all()) for n in routed[:2])


@pytest.mark.parametrize("preset_name", ["tiny", "qwen3-moe-tiny"])
def test_grouped_experts_match_sequential_mlp(single_process, preset_name, monkeypatch):
    """The grouped GEMMs ran (fc1 + fc2 forward, each one's input grad and weight grad per
    layer), with megatron's logits, grads and grad norm."""
    policy, ref = build(preset_name), build(preset_name, experts=SequentialMLP)
    assert grouped_mm_runs(policy.device.type, torch.float32)  # probed before counting calls
    calls = []
    grouped_mm = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or
                        grouped_mm(*a, **k))
    tokens_BT, valid_BT, readout_BTV = pw.batch(policy.preset.vocab_size, B=6, T=16)
    logits, norm = pw.run_model(policy, tokens_BT, valid_BT, readout_BTV)
    got = grads(policy)
    assert len(calls) == 6 * policy.preset.num_layers  # the batched path ran
    ref_logits, ref_norm = pw.run_model(ref, tokens_BT, valid_BT, readout_BTV)
    assert len(calls) == 6 * policy.preset.num_layers  # the reference did not use it
    torch.testing.assert_close(logits, ref_logits, **tol(policy, torch.float32,
                                                         dict(atol=1e-6, rtol=1e-5)))
    for name, g in as_stacked(grads(ref)).items():
        torch.testing.assert_close(got[name], g, **tol(policy, torch.float32,
                                                       dict(atol=1e-7, rtol=1e-5)),
                                   msg=lambda m: f"{name}: {m}")
    assert abs(norm - ref_norm) <= tol(policy, torch.float32, dict(rtol=1e-6))["rtol"] * ref_norm


def test_grouped_experts_bf16_match_sequential_mlp(single_process):
    policy = build("tiny", dtype=torch.bfloat16)
    tokens_BT, valid_BT, readout_BTV = pw.batch(policy.preset.vocab_size)

    def run(policy):  # bf16: the fp32 main grads as DDP's hooks accumulate them
        policy.zero_grad()
        logits = policy.logits(tokens_BT, valid_BT)
        pw.loss_fn(logits, valid_BT, readout_BTV).backward()
        return logits.detach(), grads(policy)

    logits, got = run(policy)
    ref_logits, ref = run(build("tiny", dtype=torch.bfloat16, experts=SequentialMLP))
    torch.testing.assert_close(logits, ref_logits,  # CPU: same bf16 GEMMs, same order
                               **tol(policy, torch.bfloat16, dict(atol=0, rtol=0)))
    for name, g in as_stacked(ref).items():
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
    the loop)."""
    grouped_mm_runs.cache_clear()
    try:
        with mode():
            assert grouped_mm_runs("cpu", torch.float32)
    finally:
        grouped_mm_runs.cache_clear()


def test_grouped_mm_probe_errors_that_are_not_about_kernels(single_process, monkeypatch):
    """No CUDA in this torch, or no kernel image for this GPU: "no". Out of memory or a broken
    CUDA context: raised, not cached as "no kernel" (the rest of the run would take the loop)."""
    import moe.model.experts as experts

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
    through the grouped GEMM, never the per-expert loop (the probe's cache starts empty, so the
    sampler probes under inference mode)."""
    from tests.megatron_gspo.jobs.trainers import make_trainer

    grouped_mm_runs.cache_clear()
    ran = []
    apply = ExpertMM.apply
    monkeypatch.setattr(ExpertMM, "apply", lambda *a: ran.append(a[3] is None) or apply(*a))
    try:
        trainer = make_trainer(tmp_path)
        trainer.iteration()
    finally:
        grouped_mm_runs.cache_clear()
    assert ran and all(ran), "the per-expert loop ran"


def test_a_device_without_grouped_mm_kernels_falls_back(single_process, monkeypatch):
    """Where `_grouped_mm` has no kernel (CUDA before sm90, fp32 on some torch builds) the probe
    says so once and the experts loop over the stacked weights: the same logits and grads,
    the grads still one stacked tensor per weight."""
    policy = build("tiny")
    tokens_BT, valid_BT, readout_BTV = pw.batch(policy.preset.vocab_size)
    want_logits, want_norm = pw.run_model(policy, tokens_BT, valid_BT, readout_BTV)
    want = grads(policy)

    def no_kernel(*a, **k):
        raise RuntimeError("grouped gemm is not supported on this device")

    monkeypatch.setattr(torch, "_grouped_mm", no_kernel)
    grouped_mm_runs.cache_clear()
    try:
        assert not grouped_mm_runs(policy.device.type, torch.float32)
        assert not expert_modules(policy)[0]._grouped_ok(
            torch.randn(5, policy.preset.hidden_size, device=policy.device))
        logits, norm = pw.run_model(policy, tokens_BT, valid_BT, readout_BTV)  # no_kernel
    finally:                                                                    # not called
        grouped_mm_runs.cache_clear()
    torch.testing.assert_close(logits, want_logits, atol=1e-6, rtol=1e-5)
    for name, g in grads(policy).items():
        torch.testing.assert_close(g, want[name], atol=1e-7, rtol=1e-5, msg=name)
    assert norm == pytest.approx(want_norm, rel=1e-6)


@pytest.fixture(scope="module")
def sequential_reference(single_process, tmp_path_factory):
    """test_parallel's 1-process reference, computed with megatron's SequentialMLP experts (its
    tensors in the stacked layout)."""
    from tests.moe.platform.test_parallel import single_process_reference

    ref = single_process_reference(build("tiny", experts=SequentialMLP))
    ref = {k: as_stacked(v) if isinstance(v, dict) and k != "preset" else v
           for k, v in ref.items()}
    path = tmp_path_factory.mktemp("experts") / "ref.pt"
    torch.save(ref, path)
    return str(path)


@pytest.mark.slow
def test_grouped_experts_under_ep2_match_sequential_single_process(sequential_reference):
    """EP=2 on 2 gloo processes (4 local experts per rank, both dispatchers): the stacked
    experts' logits, gathered grads, replay and KV decode equal the 1-process SequentialMLP."""
    layouts = [(1, 2, False, "alltoall"), (1, 2, False, "allgather")]
    pw.spawn(pw.worker, (2, pw.free_port(), sequential_reference, layouts), nprocs=2,
             timeout_s=TIMEOUT_S)


def test_training_forward_saves_no_copy_of_the_expert_weights(single_process):
    """What the experts' forward saves for the backward: the parameters themselves (no stacked
    or transposed copy) and the activations; the weight grads come as one stacked tensor per
    weight, in the parameter's layout."""
    policy = build("qwen3-moe-tiny")
    experts = expert_modules(policy)[0]
    weights = list(experts.parameters())
    g = torch.Generator().manual_seed(0)
    E, H = experts.num_local_experts, policy.preset.hidden_size
    counts = torch.full((E,), 3, dtype=torch.int64)
    x = torch.randn(3 * E, H, generator=g).requires_grad_()
    probs = torch.rand(3 * E, generator=g)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = experts(x, counts, probs)[0]
    weight_bytes = sum(w.nbytes for w in weights)
    params_saved = [t for t in saved if any(t is w for w in weights)]
    others = sum(t.untyped_storage().nbytes() for t in saved if not any(t is w for w in weights))
    assert len(params_saved) == 2 and others < weight_bytes / 4
    for w, grad in zip(weights, torch.autograd.grad(out.square().sum(), weights)):
        assert grad.shape == w.shape and grad.is_contiguous()


def test_an_expert_weight_changed_in_place_before_the_backward_raises(single_process):
    """The forward saves the weights for the backward (autograd's version check): a weight
    written in place in between is an error, not grads of other weights."""
    policy = build("qwen3-moe-tiny")
    tokens_BT, valid_BT, readout_BTV = pw.batch(policy.preset.vocab_size, B=6, T=16)
    policy.zero_grad()
    loss = pw.loss_fn(policy.logits(tokens_BT, valid_BT), valid_BT, readout_BTV)
    with torch.no_grad():
        expert_modules(policy)[0].linear_fc2.weight.mul_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_frozen_expert_weights_get_no_grad(single_process):
    """Experts frozen after the build get no grads; the other layers' experts still do."""
    policy = build("qwen3-moe-tiny")
    frozen = expert_modules(policy)[0]
    for p in frozen.parameters():
        p.requires_grad_(False)
    tokens_BT, valid_BT, readout_BTV = pw.batch(policy.preset.vocab_size, B=6, T=16)
    policy.zero_grad()
    pw.loss_fn(policy.logits(tokens_BT, valid_BT), valid_BT, readout_BTV).backward()
    assert not any(p.main_grad.any() for p in frozen.parameters())
    trained = expert_modules(policy)[1]
    assert all(p.main_grad.any() for p in trained.parameters())
