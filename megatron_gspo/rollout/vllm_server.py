"""The older path of `python -m megatron_gspo.rollout.vllm.server` (an engine server,
docs/vllm.md): the same command under the name it had before the vLLM backend became a room."""

import runpy

if __name__ == "__main__":
    runpy.run_module("megatron_gspo.rollout.vllm.server", run_name="__main__", alter_sys=True)
