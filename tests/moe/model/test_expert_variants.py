"""`moe.model.experts.StackedExperts` on its own, under megatron config variants the presets do not
use (clamped or offset GLU, a plain activation, probs on the input), on inputs the model does
not pass it (an expert without tokens, an expanded output grad, the per-expert loop), and the
configs it refuses. Reference: megatron's `SequentialMLP` with the same weights, one expert
module each.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

from moe.model.experts import StackedExperts
from tests.moe.model.test_experts import build, expert_modules

E, H = 8, 32  # the tiny preset's experts per layer and hidden size


@pytest.fixture(scope="module")
def template(single_process):
    """The tiny preset's first expert layer (config, process groups) and megatron's linear
    classes of its layer spec."""
    from megatron.core.transformer.mlp import MLPSubmodules

    experts = expert_modules(build("tiny"))[0]
    reference = expert_modules(build("tiny", experts=SequentialMLP))[0].local_experts[0]
    return experts, MLPSubmodules(linear_fc1=type(reference.linear_fc1),
                                  linear_fc2=type(reference.linear_fc2))


def _groups(experts):
    from megatron.core.process_groups_config import ProcessGroupCollection

    groups = ProcessGroupCollection()
    groups.ep, groups.expt_tp, groups.expt_dp = (experts.ep_group, experts.tp_group,
                                                 experts.dp_group)
    return groups


def fresh_pair(template, **config) -> tuple[StackedExperts, SequentialMLP]:
    """A new expert layer like the template's (seeded weights, its config changed by `config`),
    and megatron's `SequentialMLP` holding the same weights."""
    experts, submodules = template
    cfg = copy.deepcopy(experts.config)
    for key, value in config.items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    ours = StackedExperts(E, cfg, submodules, _groups(experts))
    ref = SequentialMLP(E, cfg, submodules, _groups(experts))
    with torch.no_grad():  # megatron's init (std 0.02) leaves the activations near 0
        for p in ours.parameters():
            p.normal_(0.0, 0.3)
        for e, mlp in enumerate(ref.local_experts):
            mlp.linear_fc1.weight.copy_(ours.linear_fc1.weight[e])
            mlp.linear_fc2.weight.copy_(ours.linear_fc2.weight[e])
    return ours, ref


def inputs(scale: float = 1.0, seed: int = 0, counts=(3, 0, 5, 2, 4, 1, 3, 2)):
    """(x [N, H], tokens per expert (one expert gets none), probs [N])."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor(counts)
    N = int(counts.sum())
    return scale * torch.randn(N, H, generator=g), counts, torch.rand(N, generator=g)


def assert_same(ours, ref, x, counts, probs, grad_of=lambda out: out.square().sum()):
    """Equal outputs, input grads and weight grads (the reference's stacked)."""
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = ours(x1, counts, probs)[0], ref(x2, counts, probs)[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    weights = [ours.linear_fc1.weight, ours.linear_fc2.weight]
    ref_weights = [p for m in ref.local_experts for p in (m.linear_fc1.weight,
                                                          m.linear_fc2.weight)]
    dx, *dw = torch.autograd.grad(grad_of(got), [x1, *weights])
    ref_dx, *ref_dw = torch.autograd.grad(grad_of(want), [x2, *ref_weights])
    torch.testing.assert_close(dx, ref_dx, atol=1e-5, rtol=1e-5)
    for i, grad in enumerate(dw):
        torch.testing.assert_close(grad, torch.stack(ref_dw[i::2]), atol=1e-5, rtol=1e-5)
    return got


@pytest.mark.parametrize("config", [dict(activation_func_clamp_value=0.5),
                                    dict(glu_linear_offset=1.0),
                                    dict(gated_linear_unit=False, activation_func=F.gelu)])
def test_activation_variants_match_megatrons_mlp(template, config):
    """Clamped GLU (gate clamped above, linear half both ways), GLU with a linear offset, and a
    plain activation: output and grads equal megatron's MLP, and the variant matters here
    (the output differs from the default config's on the same weights)."""
    ours, ref = fresh_pair(template, **config)
    x, counts, probs = inputs(scale=3.0)
    assert ours._grouped_ok(x)
    got = assert_same(ours, ref, x, counts, probs)
    if "gated_linear_unit" not in config:
        default, _ = fresh_pair(template)
        assert not torch.allclose(default(x, counts, probs)[0], got, atol=1e-3)


def test_probs_on_the_input_match_megatron(template):
    """`moe_apply_probs_on_input` (top-1): the input scaled by the probs, the output not."""
    ours, ref = fresh_pair(template, moe_apply_probs_on_input=True, moe_router_topk=1)
    assert_same(ours, ref, *inputs())


@pytest.mark.parametrize("counts", [(3, 0, 5, 2, 4, 1, 3, 2), (0, 0, 20, 0, 0, 0, 0, 0)])
def test_the_per_expert_loop_matches_megatron(template, monkeypatch, counts):
    """Where the grouped GEMM does not run, the loop over the stacked weights: megatron's
    numbers, experts without tokens get zero grads; also for an expanded (stride-0) output
    grad."""
    ours, ref = fresh_pair(template)
    x, counts, probs = inputs(counts=counts)
    monkeypatch.setattr(ours, "_grouped_ok", lambda *a: False)
    assert_same(ours, ref, x, counts, probs)
    assert_same(ours, ref, x, counts, probs, grad_of=lambda out: out.sum())  # ones, expanded


def test_an_expanded_output_grad_on_the_grouped_gemm(template):
    """`_grouped_mm` rejects stride-0 grads: `ExpertMM` makes them dense first."""
    ours, ref = fresh_pair(template)
    assert_same(ours, ref, *inputs(), grad_of=lambda out: out.sum())


def test_an_input_without_grad_still_gives_weight_grads(template):
    """Layers before the experts frozen (the input needs no grad): the weights still get
    theirs, megatron's."""
    ours, ref = fresh_pair(template)
    x, counts, probs = inputs()
    ours(x, counts, probs)[0].square().sum().backward()
    ref(x, counts, probs)[0].square().sum().backward()
    torch.testing.assert_close(ours.linear_fc2.weight.grad,
                               torch.stack([m.linear_fc2.weight.grad for m in ref.local_experts]),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("config,patch", [(dict(add_bias_linear=True), None),
                                          (dict(fp8="hybrid"), None), (dict(), "tp2")])
def test_configs_it_cannot_run_are_refused_at_construction(template, config, patch):
    """Biases, fp8, expert tensor parallelism: a ValueError naming it, not other numbers."""
    experts, submodules = template
    cfg = copy.deepcopy(experts.config)
    for key, value in config.items():
        setattr(cfg, key, value)
    groups = _groups(experts)
    if patch == "tp2":
        groups.expt_tp = type("Group", (), {"size": lambda self: 2})()
    with pytest.raises(ValueError, match="StackedExperts does not support"):
        StackedExperts(E, cfg, submodules, groups)
