"""`moe.experts.GroupedSequentialMLP` on its own, under megatron config variants the presets do
not use (clamped or offset GLU, a plain activation, biases, probs on the input, expert TP) and
on inputs the model does not pass it (no input grad, no `main_grad`, an expanded output grad,
a precomputed weight stack). Reference: megatron's `SequentialMLP.forward` on the same module.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

from moe.experts import GroupedSequentialMLP
from tests.moe.test_experts import build, expert_modules

E, H = 8, 32  # the tiny preset's experts per layer and hidden size


@pytest.fixture(scope="module")
def template(single_process):
    """The tiny preset's first expert layer: config, process groups and linear classes."""
    return expert_modules(build("tiny"))[0]


def fresh_experts(template, **config) -> GroupedSequentialMLP:
    """A new expert layer like `template` (seeded weights), its config changed by `config`."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.mlp import MLPSubmodules

    cfg = copy.deepcopy(template.config)
    for key, value in config.items():
        setattr(cfg, key, value)
    groups = ProcessGroupCollection()
    groups.ep, groups.expt_tp, groups.expt_dp = (template.ep_group, template.tp_group,
                                                 template.dp_group)
    linear = template.local_experts[0]
    submodules = MLPSubmodules(linear_fc1=type(linear.linear_fc1),
                               linear_fc2=type(linear.linear_fc2))
    torch.manual_seed(0)
    experts = GroupedSequentialMLP(E, cfg, submodules, groups)
    with torch.no_grad():  # megatron's init (std 0.02) leaves the activations near 0
        for p in experts.parameters():
            p.normal_(0.0, 0.3)
    return experts


def inputs(scale: float = 1.0, seed: int = 0):
    """(x [N, H], tokens per expert (one expert gets none), probs [N])."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor([3, 0, 5, 2, 4, 1, 3, 2])
    N = int(counts.sum())
    return scale * torch.randn(N, H, generator=g), counts, torch.rand(N, generator=g)


def forward_both(experts, x, counts, probs):
    """(grouped output, megatron's loop output) on the same module and inputs."""
    assert experts._grouped_ok(x)
    return experts(x, counts, probs)[0], SequentialMLP.forward(experts, x, counts, probs)[0]


@pytest.mark.parametrize("config", [dict(activation_func_clamp_value=0.5),
                                    dict(glu_linear_offset=1.0),
                                    dict(gated_linear_unit=False, activation_func=F.gelu)])
def test_activation_variants_match_megatrons_mlp(template, config):
    """Clamped GLU (gate clamped above, linear half both ways), GLU with a linear offset, and a
    plain activation: the grouped forward equals megatron's MLP, and the variant matters here
    (the output differs from the default config's on the same weights)."""
    experts = fresh_experts(template, **config)
    x, counts, probs = inputs(scale=3.0)
    got, want = forward_both(experts, x, counts, probs)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if "gated_linear_unit" not in config:
        default = fresh_experts(template)
        assert not torch.allclose(default(x, counts, probs)[0], got, atol=1e-3)


@pytest.mark.parametrize("config,patch", [
    (dict(add_bias_linear=True), None), (dict(moe_apply_probs_on_input=True), None),
    (dict(), "tp2"), (dict(), "bf16 input"), (dict(), "3-D input")])
def test_variants_the_grouped_gemm_cannot_run_take_the_loop(template, config, patch):
    """Biases, probs applied on the input, expert tensor parallelism, an input in another dtype
    than the weights, a non-2-D input: `_grouped_ok` says no (the forward runs megatron's
    loop)."""
    experts = fresh_experts(template, **config)
    x, _, _ = inputs()
    if patch == "tp2":
        experts.tp_group = type("Group", (), {"size": lambda self: 2})()
    elif patch == "bf16 input":
        x = x.bfloat16()
    elif patch == "3-D input":
        x = x.unsqueeze(0)
    assert not experts._grouped_ok(x)
    assert fresh_experts(template)._grouped_ok(inputs()[0])


def test_weights_without_main_grad_get_autograd_grads(template):
    """`grads_into_main_grad` set, the input needs grad, but the weights have no `main_grad` (no
    DDP): the autograd path, grads equal to megatron's loop; also for an expanded (stride-0)
    output grad."""
    experts = fresh_experts(template)
    experts.grads_into_main_grad = True
    x, counts, probs = inputs()
    got, want = forward_both(experts, x.requires_grad_(), counts, probs)
    weights = list(experts.parameters())
    torch.testing.assert_close(torch.autograd.grad(got.sum(), weights),  # ones, expanded
                               torch.autograd.grad(want.sum(), weights), atol=1e-5, rtol=1e-5)


def test_an_input_without_grad_still_gives_weight_grads(template):
    """Layers before the experts frozen (the input needs no grad): the weights still get their
    grads (through autograd: the direct `main_grad` path needs the input to need grad)."""
    experts = fresh_experts(template)
    experts.grads_into_main_grad = True
    for p in experts.parameters():
        p.main_grad = torch.zeros_like(p)
    x, counts, probs = inputs()
    got, want = forward_both(experts, x, counts, probs)
    got.square().sum().backward()
    for p in experts.parameters():
        assert p.grad is not None
    grads = torch.autograd.grad(want.square().sum(), list(experts.parameters()))
    for p, g in zip(experts.parameters(), grads):
        torch.testing.assert_close(p.grad, g, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_a_precomputed_stack_is_the_one_multiplied(template):
    """`forward(..., stacked=...)` (the sampler stacks once per rollout) uses the stack it is
    given, not the module's current weights."""
    experts = fresh_experts(template)
    x, counts, probs = inputs()
    w1, w2 = experts.stacked_weights()
    want = experts(x, counts, probs)[0]
    torch.testing.assert_close(experts(x, counts, probs, stacked=(w1, 2 * w2))[0], 2 * want)
