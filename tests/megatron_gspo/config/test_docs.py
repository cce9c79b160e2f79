"""megatron_gspo.config.docs: every key has a docstring, and `megatron-gspo config` lists every
key with its type, default and docstring."""

import dataclasses

from megatron_gspo.config.schema import RunConfig, describe_config, field_docs


def sections(cls) -> list:
    """`cls` and every section under it, nested ones too (rollout.vllm)."""
    return [cls] + [c for f in dataclasses.fields(cls)
                    if dataclasses.is_dataclass(t := type(getattr(cls(), f.name)))
                    for c in sections(t)]


def test_every_field_has_a_docstring():
    seen = 0
    for cls in sections(RunConfig):
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name, "").strip(), f"{cls.__name__}.{f.name} has no docstring"
            seen += 1
    # every field of every section (rollout: 15, and its vllm section: 14)
    assert seen == 15 + 15 + 5 + 15 + 14 + 10 + 14 + 14 + 7 + 3 + 15 + 4 + 3


def test_describe_config_lists_every_key_with_default_and_doc():
    text = describe_config()
    for key, default in [("run_dir", "'runs/default'"), ("model.preset", "'qwen3-moe-tiny'"),
                         ("train.routing_replay", "'off'"), ("loss.eps_low", "None"),
                         ("sft.lr", "0.003"), ("wandb.name", "None")]:
        line = next(ln for ln in text.splitlines() if ln.startswith(key + ":"))
        assert line.endswith("= " + default), line
    assert "train.num_minibatches: int = 4" in text
    assert "must divide prompts_per_batch * group_size" in text
    n_keys = sum(1 for ln in text.splitlines() if ln and not ln.startswith((" ", "[", "megat")))
    assert n_keys == 4 + 15 + 5 + 14 + 14 + 10 + 14 + 14 + 7 + 3 + 15 + 4 + 3
    assert "rollout.vllm.tensor_parallel_size: int = 1" in text  # a nested section's keys


def test_field_docs_and_defaults_as_declared():
    """Guards `field_docs` (a subclass's docstring of a re-declared field wins over its base's)
    and `describe_fields` (a default_factory's value is shown, not MISSING)."""
    import dataclasses

    from megatron_gspo.config.docs import describe_fields

    @dataclasses.dataclass(frozen=True)
    class Base:
        x: int = 1
        """base doc"""
        y: list = dataclasses.field(default_factory=lambda: [1, 2])
        """a list"""

    @dataclasses.dataclass(frozen=True)
    class Sub(Base):
        x: int = 2
        """sub doc"""

    assert field_docs(Sub) == {"x": "sub doc", "y": "a list"}
    lines = []
    describe_fields(Sub, "s.", lines)
    assert lines == ["s.x: int = 2", "    sub doc", "s.y: list = [1, 2]", "    a list"]
