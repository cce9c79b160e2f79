"""A run's record and its parts' settings: records written before a key was read into another
resume (rollout.decoder into rollout.backend); a part's own settings (`megatron_gspo.config.parts`)
are saved spelled out, and a resume compares them as a section's fields are compared (those
marked may_change may change)."""

import json

import pytest

from megatron_gspo.config.schema import config_to_dict, load_config
from megatron_gspo.errors import RunDirError
from megatron_gspo.run.rundir import RUN_FILE, fingerprint, semantic_config
from tests.megatron_gspo.run.test_rundir import UNUSED, claim


def test_a_record_from_before_rollout_decoder_was_read_into_backend_resumes(tmp_path):
    """run.json written while `rollout.decoder` chose lean | megatron under backend=lean holds
    both keys: the megatron decoder's run resumes as rollout.backend=megatron (or its older
    spelling), a vLLM run's record (decoder: lean beside backend: vllm) as backend=vllm; a
    changed backend is still refused."""
    for backend, record, same in (("megatron", ("lean", "megatron"), "rollout.decoder=megatron"),
                                  ("vllm", ("vllm", "lean"), "rollout.backend=vllm")):
        run_dir = tmp_path / backend
        run_dir.mkdir()
        cfg = config_to_dict(load_config(None, [f"run_dir={run_dir}",
                                                f"rollout.backend={backend}"]))
        old = semantic_config(cfg, UNUSED["train"])
        old["rollout.backend"], old["rollout.decoder"] = record
        (run_dir / RUN_FILE).write_text(json.dumps(
            {"job": "train", "fingerprint": fingerprint(old), "config": old}))
        claim(run_dir, "train", f"rollout.backend={backend}").release()
        claim(run_dir, "train", same).release()
        with pytest.raises(RunDirError, match=rf"\(rollout.backend: '{backend}' -> 'lean'\)"):
            claim(run_dir, "train", "rollout.backend=lean")
