"""megatron_gspo.config.vllm: the `rollout.vllm` section nested in `rollout` (YAML, overrides,
the saved config) and its rules, each a one-line ConfigError naming the dotted key."""

import pytest

from megatron_gspo.config.schema import load_config, save_config
from megatron_gspo.config.vllm import split_address
from megatron_gspo.errors import ConfigError


def test_a_nested_section_loads_from_yaml_and_overrides_and_round_trips(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("rollout:\n  backend: vllm\n  vllm:\n    mode: server\n"
                    "    tensor_parallel_size: 2\n")
    cfg = load_config(str(path), ["rollout.vllm.chunk_mb=4", "rollout.vllm.port=9000"])
    v = cfg.rollout.vllm
    assert (v.mode, v.tensor_parallel_size, v.chunk_mb, v.port) == ("server", 2, 4.0, 9000)
    assert cfg.rollout.backend == "vllm"  # the section's siblings as given
    save_config(cfg, str(tmp_path / "saved.yaml"))
    assert load_config(str(tmp_path / "saved.yaml")) == cfg


@pytest.mark.parametrize("overrides, match", [
    (["rollout.vllm.tensor_parallel_size=2"],
     r"^rollout.vllm.tensor_parallel_size=2: needs rollout.vllm.mode=server"),
    (["rollout.vllm.addresses=[\"h:1\"]"], r"^rollout.vllm.addresses=\['h:1'\]: needs"),
    (["rollout.vllm.mode=server", "rollout.vllm.addresses=[\"nohost\"]"],
     r"^rollout.vllm.addresses=\['nohost'\]: expected a list of \"host:port\""),
    (["rollout.vllm.mode=server", "rollout.vllm.addresses=[\"10.1.1.1:8000\"]"],
     r"^rollout.vllm.sync_host=None: must be an address of the trainer's rank 0"),
    (["rollout.vllm.mode=server", "rollout.vllm.addresses=[\"a:1\",\"b:2\"]",
      "rollout.vllm.replicas=3", "rollout.vllm.sync_host=t"],
     r"^rollout.vllm.replicas=3: must be 1 or len\(rollout.vllm.addresses\)=2"),
    (["rollout.vllm.mode=remote"], r"^rollout.vllm.mode=remote: expected one of"),
    (["rollout.vllm.chunk_mb=0"], r"^rollout.vllm.chunk_mb=0.0: must be > 0"),
    (["rollout.vllm.mode=server", "rollout.vllm.port=65535", "rollout.vllm.replicas=2"],
     r"^rollout.vllm.port=65535: must be < 65536 - replicas"),
    (["rollout.vllm.tp=2"], r"^unknown config key 'rollout.vllm.tp'; valid keys of "
                            r"rollout.vllm: dtype, kv_cache_gb, push_check_tol, mode, "
                            r"tensor_parallel_size"),
])
def test_bad_values_are_one_line_naming_the_dotted_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_engines_on_this_machine_need_no_sync_host():
    cfg = load_config(None, ["rollout.vllm.mode=server",
                             "rollout.vllm.addresses=[\"127.0.0.1:8000\",\"localhost:8001\"]"])
    assert cfg.rollout.vllm.num_replicas == 2 and cfg.rollout.vllm.sync_host is None


def test_split_address():
    assert split_address("h:80") == ("h", 80)
    assert split_address("[::1]:8000") == ("::1", 8000)
    assert split_address("h") is None and split_address("h:0") is None
    assert split_address(":80") is None and split_address("h:x") is None
