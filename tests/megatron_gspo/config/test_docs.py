"""megatron_gspo.config.docs: every key has a docstring, and `megatron-gspo config` lists every
key with its type, default and docstring."""

import dataclasses

from megatron_gspo.config import parts
from megatron_gspo.config.docs import RESUMABLE
from megatron_gspo.config.schema import RunConfig, describe_config, field_docs


def _sections(cls=RunConfig) -> list[type]:
    """`cls` and the class of each section under it, nested ones too (rollout.vllm)."""
    return [cls] + [c for f in dataclasses.fields(cls)
                    if dataclasses.is_dataclass(t := type(getattr(cls(), f.name)))
                    for c in _sections(t)]


def _leaf_keys() -> int:
    """Keys a user can set: every field of every section, the sections themselves and a
    section's parts' settings (keys of the parts, `parts.SETTINGS`) excepted."""
    return sum(not dataclasses.is_dataclass(getattr(cls(), f.name)) and not f.metadata.get(
        parts.PART) for cls in _sections() for f in dataclasses.fields(cls))


def test_every_field_has_a_docstring():
    seen = 0
    for cls in _sections():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name, "").strip(), f"{cls.__name__}.{f.name} has no docstring"
            seen += 1
    assert len(_sections()) >= 12 and seen > _leaf_keys() > 100  # every section was walked
    assert any(cls.__name__ == "VLLMConfig" for cls in _sections())  # nested ones too


def test_describe_config_lists_every_key_with_default_and_doc():
    text = describe_config()
    for key, default in [("run_dir", "'runs/default'"), ("model.preset", "'qwen3-moe-tiny'"),
                         ("train.routing_replay", "'off'"), ("sft.lr", "0.003"),
                         ("wandb.name", "None")]:
        line = next(ln for ln in text.splitlines() if ln.startswith(key + ":"))
        assert line.removesuffix(RESUMABLE).endswith("= " + default), line
    assert "train.num_minibatches: int = 4" in text
    assert "must divide prompts_per_batch * group_size" in text
    n_keys = sum(1 for ln in text.splitlines() if ln and not ln.startswith((" ", "[", "megat")))
    own = sum(len(dataclasses.fields(e.cls)) for kind in parts.SETTINGS.values()
              for e in kind.values())
    assert n_keys == _leaf_keys() + own  # every key, once; a part's own, once per part
    # each loss lists its own settings: its clip range, at its defaults
    grpo = text[text.index("[loss, loss.name=grpo] the loss's own settings"):]
    assert grpo.splitlines()[1] == "loss.eps_low: float = 0.2"
    assert "rollout.vllm.tensor_parallel_size: int = 1" in text  # a nested section's keys


def test_the_listing_marks_what_a_resume_may_change():
    """A key (or section) marked `fields.may_change` says so in `megatron-gspo config`."""
    lines = describe_config().splitlines()
    marked = {ln.split(":")[0].strip("[]").split("]")[0] for ln in lines if ln.endswith(RESUMABLE)}
    assert {"run_dir", "train.steps", "rollout.vllm.mode", "rollout.vllm.kv_cache_gb",
            "wandb"} <= marked
    assert not marked & {"train.routing_replay", "rollout.vllm.dtype", "optim.lr", "rollout"}


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
