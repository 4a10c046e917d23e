"""The only module that talks to vLLM (offline ``LLM``): response generation for the generate stage.

On CPU, vLLM reserves one core for its front end unless told otherwise; on a 2-core machine that halves
throughput, so expman gives the engine every core unless the user set the variables. The engine runs in a
spawned process: callers need an ``if __name__ == "__main__":`` guard (the stage scripts have one).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from expman.errors import ExpmanError
from expman.generate import GenOutput, Messages
from expman.params import GenerateParams

__all__ = ["VllmGenerator"]


def _cpu_defaults() -> None:
    cores = os.cpu_count() or 1
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{cores - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")


class VllmGenerator:
    """Generation through ``vllm.LLM.chat`` with the verifier's chat template."""

    def __init__(self, model_dir: Path, params: GenerateParams):
        from expman.verifier import load_verifier_manifest, resolve_device

        try:
            import vllm
        except ImportError:
            raise ExpmanError("generate.backend: vllm is not installed (pip install '.[engine]')") from None
        device = resolve_device(params.device)
        if device == "cpu":
            _cpu_defaults()
        dtype = {"auto": "float32" if device == "cpu" else "bfloat16"}.get(params.dtype, params.dtype)
        self.params = params
        self.sampling = vllm.SamplingParams(
            temperature=params.temperature, max_tokens=params.max_new_tokens, seed=params.seed
        )
        self.llm = vllm.LLM(
            model=str(model_dir),
            dtype=dtype,
            seed=params.seed,
            tensor_parallel_size=params.tensor_parallel_size,
            trust_remote_code=load_verifier_manifest(model_dir)["trust_remote_code"],
        )

    def generate(self, batch: Sequence[Messages]) -> list[GenOutput]:
        outputs = self.llm.chat(
            list(batch),
            self.sampling,
            chat_template_kwargs=self.params.chat_template_kwargs or None,
            use_tqdm=False,
        )
        return [
            GenOutput(
                list(o.prompt_token_ids),
                list(o.outputs[0].token_ids),
                o.outputs[0].text,
                o.outputs[0].finish_reason or "stop",
            )
            for o in outputs
        ]
