"""The only module that talks to vLLM (offline ``LLM``): response generation for the generate stage, the
verifier's hidden states for the extract stage (vLLM's ``extract_hidden_states`` method), and the benchmark
stage's serving engine (``VllmEngine``, the interface of ``expman.engines.serving``: timed arms without speculation
or with EAGLE-3 at k draft tokens, their spec-decode counters, the hidden states of the parity check).

On CPU, vLLM reserves one core for its front end unless told otherwise; on a 2-core machine that halves
throughput, so expman gives the engine every core unless the user set the variables. On CPU every engine runs its
core in the caller's process (vLLM's default spawns two processes that each import vLLM), and the extraction and
benchmark engines get a KV cache sized to their prompts instead of vLLM CPU's 4 GiB: those spawns and that cache
were most of a short engine run's time. Elsewhere engines run spawned (callers need an
``if __name__ == "__main__":`` guard; the stage scripts have one).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from expman.engines.generation import GenOutput, Messages
from expman.engines.metrics import AcceptanceCounters, from_vllm_metrics
from expman.engines.serving import ArmResult, ArmSetup
from expman.errors import ExpmanError
from expman.params import GenerateParams

__all__ = ["VllmEngine", "VllmGenerator", "VllmHiddenStates", "vllm_version"]


EAGER = {"compilation_config": {"mode": 0}, "enforce_eager": True}
"""Engine settings without torch.compile (and without CUDA graphs)."""


CPU_KV_CACHE = {"kv_cache_memory_bytes": 4 << 30}
"""The KV cache of a generation engine on CPU (``VLLM_CPU_KVCACHE_SPACE``, when set, wins)."""

DRAIN_STEPS = 16
"""Engine steps allowed for writing out the last finished requests' states (one is enough in vLLM 0.32)."""

PREFILL_STEP_TOKENS = 8192
"""Prompt tokens per engine step when extracting states on CPU."""


def _cpu_defaults(ranks: int = 1) -> None:
    """Every core to the engine, split evenly among its ``ranks`` (tensor-parallel workers): vLLM CPU wants one
    core list per rank in ``VLLM_CPU_OMP_THREADS_BIND``, separated by ``|``."""
    cores = os.cpu_count() or 1
    if ranks > cores:
        raise ExpmanError(f"tensor_parallel_size {ranks} needs {ranks} cores on CPU; this machine has {cores}")
    each = cores // ranks
    groups = [f"{rank * each}-{(rank + 1) * each - 1}" for rank in range(ranks)]
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(groups))


@contextlib.contextmanager
def _engine_core_in_process() -> Iterator[None]:
    """Engines started inside run their core (and, with one rank, their worker) in this process; vLLM's default
    spawns both.

    vLLM reads ``VLLM_ENABLE_V1_MULTIPROCESSING`` when an engine starts, and an engine core that runs here freezes
    vLLM's view of the environment: the variable is set for this block alone and that view is reset around it, so
    a later engine (e.g. one on a GPU, which stays spawned) starts as it would have."""
    import vllm.envs

    key = "VLLM_ENABLE_V1_MULTIPROCESSING"
    before = os.environ.get(key)
    os.environ[key] = "0"
    vllm.envs.disable_envs_cache()
    try:
        yield
    finally:
        if before is None:
            del os.environ[key]
        else:
            os.environ[key] = before
        vllm.envs.disable_envs_cache()


def _kv_token_bytes(model_dir: Path, drafter_dir: Path | None, dtype: str) -> int | None:
    """KV-cache bytes per token of the verifier (and the drafter's layers), None for an attention without per-head
    keys and values (e.g. MLA), whose cache is left to vLLM."""
    from expman.drafter.checkpoint import read_checkpoint

    config = json.loads((model_dir / "config.json").read_text())
    config = config.get("text_config", config)
    try:
        kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        layers = config["num_hidden_layers"]
    except KeyError:
        return None
    if config.get("kv_lora_rank"):
        return None
    if drafter_dir is not None:
        layers += read_checkpoint(drafter_dir)[1].layer.get("num_hidden_layers", 1)
    return 2 * layers * kv_heads * head_dim * _dtype_bytes(dtype)


def _dtype_bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def _blocks(tokens: int) -> int:
    """``tokens`` rounded up to whole 256-token blocks."""
    return -(-tokens // 256) * 256


def _batch_kv_cache(
    model_dir: Path, drafter_dir: Path | None, prompts: Sequence[Sequence[int]], new_tokens: int, dtype: str
) -> dict[str, int]:
    """``max_model_len`` and ``kv_cache_memory_bytes`` for one batch of ``prompts``: every request fits at once,
    twice over, in whole 256-token blocks ({} for MLA)."""
    token_bytes = _kv_token_bytes(model_dir, drafter_dir, dtype)
    if token_bytes is None:
        return {}
    length = _blocks(max(map(len, prompts)) + new_tokens)
    return {"max_model_len": length, "kv_cache_memory_bytes": 2 * len(prompts) * length * token_bytes}


def _prefill_kv_cache(model_dir: Path, layer_ids: Sequence[int], max_prompt_tokens: int, dtype: str) -> dict:
    """``max_model_len``, the prefill budget per step and ``kv_cache_memory_bytes`` for prefill-only requests of at
    most ``max_prompt_tokens``: the verifier's cache plus the captured states, for two steps' worth of prompts (a
    finished request's blocks are freed one step later, once its states are written), twice over ({} for MLA)."""
    token_bytes = _kv_token_bytes(model_dir, None, dtype)
    if token_bytes is None:
        return {}
    config = json.loads((model_dir / "config.json").read_text())
    hidden = config.get("text_config", config)["hidden_size"]
    length = _blocks(max_prompt_tokens + 1)
    step_tokens = max(length, PREFILL_STEP_TOKENS)
    token_bytes += len(layer_ids) * hidden * _dtype_bytes(dtype)
    return {
        "max_model_len": length,
        "max_num_batched_tokens": step_tokens,
        "kv_cache_memory_bytes": 2 * 2 * (step_tokens + length) * token_bytes,
    }


class VllmGenerator:
    """Generation through ``vllm.LLM.chat`` with the verifier's chat template."""

    def __init__(self, model_dir: Path, params: GenerateParams, trust_remote_code: bool):
        from expman.devices import dtype_name, resolve_device

        try:
            import vllm
        except ImportError:
            raise ExpmanError("generate.backend: vllm is not installed (pip install '.[engine]')") from None
        device = resolve_device(params.device)
        cpu = {}
        if device == "cpu":
            _cpu_defaults(params.tensor_parallel_size)
            # the compile warmup cost more than it gave back: on 2 AVX2 cores in fp32, engine start 125 s compiled
            # against 15 s eager, answers 178 against 165 tok/s (96 prompts x 128 tokens in calls of 48)
            cpu = CPU_KV_CACHE | EAGER
        dtype = dtype_name(params.dtype, device)
        self.params = params
        whole_prefills = {}
        if device == "cpu" and params.samples():
            # vLLM CPU 0.32 crashes ("CPU Generator does not use offset") when it rewinds a seeded request's
            # generator after a partial prefill; with chunked prefill off every prefill is whole
            length = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings", 8192)
            whole_prefills = {
                "enable_chunked_prefill": False,
                "max_model_len": length,
                "max_num_batched_tokens": length,
            }
        with _engine_core_in_process() if device == "cpu" else contextlib.nullcontext():
            self.llm = vllm.LLM(
                model=str(model_dir),
                dtype=dtype,
                seed=params.seed,
                tensor_parallel_size=params.tensor_parallel_size,
                trust_remote_code=trust_remote_code,
                **whole_prefills,
                **cpu,
            )

    def close(self) -> None:
        """Stop the engine core now, not in interpreter teardown (where its logging fails noisily)."""
        _shutdown(self.llm)

    def generate(self, batch: Sequence[Messages], temperature: float, seeds: Sequence[int]) -> list[GenOutput]:
        import vllm

        sampling = [
            vllm.SamplingParams(
                temperature=temperature, max_tokens=self.params.max_new_tokens, seed=seed if temperature else None
            )
            for seed in seeds
        ]
        outputs = self.llm.chat(
            list(batch),
            sampling,
            chat_template_kwargs=self.params.chat_template_kwargs or None,
            use_tqdm=False,
        )
        return [_gen_output(o) for o in outputs]

    def complete(
        self, prompts: Sequence[list[int]], temperature: float, seeds: Sequence[int], max_new_tokens: int
    ) -> list[GenOutput]:
        """Continue token-id prompts (no chat template applied), each request seeded."""
        import vllm

        sampling = [vllm.SamplingParams(temperature=temperature, max_tokens=max_new_tokens, seed=s) for s in seeds]
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sampling, use_tqdm=False)
        return [_gen_output(o) for o in outputs]


def _gen_output(request: Any) -> GenOutput:
    output = request.outputs[0]
    return GenOutput(
        list(request.prompt_token_ids), list(output.token_ids), output.text, output.finish_reason or "stop"
    )


def _shutdown(llm: Any) -> None:
    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None:
        core.shutdown()


def vllm_version() -> str | None:
    from importlib import metadata

    for name in ("vllm", "vllm-cpu"):
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return None


class VllmEngine:
    """vLLM's offline ``LLM`` as a serving engine (``expman.engines.serving``): arms, counters and hidden states."""

    name = "vllm"
    states_unsupported = None

    def version(self) -> str | None:
        return vllm_version()

    def run_arm(self, setup: ArmSetup, drafter_dir: Path | None, k: int) -> ArmResult:
        """Greedy generation of every prompt (token ids) in one batch; with ``drafter_dir``, EAGLE-3 speculation
        with a chain of ``k``; without ``setup.compile`` the engine runs eagerly."""
        try:
            import vllm
        except ImportError:
            raise ExpmanError("benchmark.engine: vllm is not installed (pip install '.[engine]')") from None
        prompts, device, dtype = setup.prompts, setup.device, setup.dtype
        settings: dict[str, Any] = {
            "dtype": dtype,
            "seed": setup.seed,
            "max_new_tokens": setup.max_new_tokens,
            "batch": len(prompts),
            "compile": setup.compile,
            "engine_core": "in-process" if device == "cpu" else "spawned",
        }
        if drafter_dir is not None:
            settings["speculative_config"] = {
                "method": "eagle3",
                "model": str(drafter_dir),
                "num_speculative_tokens": k,
            }
        cpu = {}
        if device == "cpu":
            _cpu_defaults()
            cpu = _batch_kv_cache(setup.model_dir, drafter_dir, prompts, setup.max_new_tokens + k + 1, dtype)
            settings.update(cpu)
        with _engine_core_in_process() if device == "cpu" else contextlib.nullcontext():
            return _timed_batch(
                vllm.LLM(  # unnamed: _timed_batch holds the only reference and frees the engine after its batch
                    model=str(setup.model_dir),
                    dtype=dtype,
                    seed=setup.seed,
                    disable_log_stats=False,  # keeps the spec-decode counters get_metrics() reads
                    trust_remote_code=setup.trust_remote_code,
                    speculative_config=settings.get("speculative_config"),
                    **({} if setup.compile else EAGER),
                    **cpu,
                ),
                prompts,
                setup.max_new_tokens,
                settings,
            )

    def acceptance(self, arm: ArmResult) -> AcceptanceCounters:
        """The deltas of vLLM's cumulative counters (``get_metrics()``) around the timed batch."""
        return from_vllm_metrics(arm.raw["metrics_after"]) - from_vllm_metrics(arm.raw["metrics_before"])

    def hidden_states(
        self,
        model_dir: Path,
        layer_ids: Sequence[int],
        prompts: Sequence[Sequence[int]],
        device: str,
        dtype: str,
        trust_remote_code: bool,
    ) -> list[Any]:
        """One engine start (``VllmHiddenStates``, one rank) for all the prompts."""
        engine = VllmHiddenStates(model_dir, layer_ids, device, dtype, 1, trust_remote_code, max(map(len, prompts)))
        try:
            return engine.states(prompts)
        finally:
            engine.close()


def _timed_batch(llm: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, settings: dict) -> ArmResult:
    """One warm-up request, then every prompt greedy in one timed batch; the engine is shut down after."""
    import gc

    import vllm

    try:
        greedy = vllm.SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
        llm.generate([{"prompt_token_ids": list(prompts[0])}], vllm.SamplingParams(max_tokens=4), use_tqdm=False)
        before = llm.get_metrics()
        started = time.perf_counter()
        results = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], greedy, use_tqdm=False)
        seconds = time.perf_counter() - started
        after = llm.get_metrics()
    finally:
        _shutdown(llm)
        del llm
        gc.collect()
    outputs = [list(r.outputs[0].token_ids) for r in results]
    return ArmResult(outputs, seconds, settings, {"metrics_before": before, "metrics_after": after})


class VllmHiddenStates:
    """The verifier's hidden states at ``layer_ids`` for token-id prompts, computed by vLLM's own model code.

    vLLM's ``extract_hidden_states`` speculative method stores, for every prompt token, the residual stream at
    each id (HF ``hidden_states`` convention: id k = output of layer k-1, id N = the last layer before the final
    norm) in a KV cache of its own; a KV connector writes it out per request as one safetensors file under a
    private folder (in /dev/shm where there is one), which is read and deleted here. Prefix caching is off: a
    cache hit would reuse blocks another request wrote."""

    def __init__(
        self,
        model_dir: Path,
        layer_ids: Sequence[int],
        device: str,
        dtype: str,
        tensor_parallel_size: int,
        trust_remote_code: bool,
        max_prompt_tokens: int,
        expert_parallel: bool = False,
    ):
        try:
            import vllm
        except ImportError:
            raise ExpmanError("extract.backend: vllm is not installed (pip install '.[engine]')") from None
        cpu = {}
        if device == "cpu":
            if expert_parallel:  # measured: a segfault in csrc/cpu/cpu_fused_moe.cpp, Qwen3-MoE with 2 ranks
                raise ExpmanError("extract.expert_parallel needs GPUs: vLLM CPU 0.32's fused-MoE kernel crashes on it")
            _cpu_defaults(tensor_parallel_size)
            # on CPU the compile warmup dominated this prefill-only workload: the default graph's extract stage took
            # 194 s with it (engine init 93 s) and 110 s without (init 1 s) on 2 cores in bf16 (docs/performance.md)
            cpu = EAGER | _prefill_kv_cache(model_dir, layer_ids, max_prompt_tokens, dtype)
        self.layer_ids = list(layer_ids)
        self.columns = [sorted(set(layer_ids)).index(i) for i in layer_ids]  # the engine stores ids ascending
        self.folder = tempfile.mkdtemp(prefix="expman-states-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
        try:
            with _engine_core_in_process() if device == "cpu" else contextlib.nullcontext():
                self.llm = vllm.LLM(
                    model=str(model_dir),
                    dtype=dtype,
                    tensor_parallel_size=tensor_parallel_size,
                    enable_expert_parallel=expert_parallel,
                    trust_remote_code=trust_remote_code,
                    enable_prefix_caching=False,
                    speculative_config={
                        "method": "extract_hidden_states",
                        "num_speculative_tokens": 1,
                        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": self.layer_ids}},
                    },
                    kv_transfer_config={
                        "kv_connector": "HiddenStatesFileConnector",
                        "kv_connector_module_path": __name__,
                        "kv_role": "kv_producer",
                        "kv_connector_extra_config": {"shared_storage_path": self.folder},
                    },
                    **cpu,
                )
        except BaseException:
            shutil.rmtree(self.folder, ignore_errors=True)  # an engine that did not start leaves nothing
            raise

    def states(self, prompts: Sequence[Sequence[int]]) -> list[Any]:
        """One [T, len(layer_ids), H] tensor per prompt, the ids in ``layer_ids`` order, in the engine's dtype."""
        import vllm
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            cleanup_hidden_states,
            load_hidden_states,
        )

        requests = [{"prompt_token_ids": list(p)} for p in prompts]
        outputs = self.llm.generate(requests, vllm.SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        self._drain_saves()
        states = []
        for prompt, output in zip(prompts, outputs, strict=True):
            path = output.kv_transfer_params["hidden_states_path"]
            saved = load_hidden_states(path)  # waits for the connector's write to finish
            cleanup_hidden_states(path)
            if saved["token_ids"].tolist() != list(prompt):
                raise ExpmanError(f"vLLM hidden states: {path} holds other token ids than its request's")
            states.append(saved["hidden_states"][:, self.columns])
        return states

    def _drain_saves(self) -> None:
        """An engine core in this process steps only while ``generate`` waits for outputs, but the connector writes
        the states of the requests that finished in the last step during the step after it (the scheduler hands
        them over as that step's metadata): run those steps here. A spawned engine core runs them by itself."""
        core = getattr(self.llm.llm_engine.engine_core, "engine_core", None)  # set for an in-process core only
        for _ in range(DRAIN_STEPS):
            if core is None or not core.scheduler.has_requests():
                return
            self.llm.llm_engine.step()
        raise ExpmanError(f"vLLM hidden states: the engine still holds finished requests after {DRAIN_STEPS} steps")

    def close(self) -> None:
        _shutdown(self.llm)
        shutil.rmtree(self.folder, ignore_errors=True)


def __getattr__(name: str) -> Any:
    """``HiddenStatesFileConnector`` is built on first access (vLLM's connector factory looks it up by name in
    this module), so importing this module does not import vLLM."""
    if name == "HiddenStatesFileConnector":
        return _hidden_states_file_connector()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _hidden_states_file_connector() -> type:
    """vLLM's own hidden-states connector, with a host-memory path for the CPU build.

    In vLLM 0.32 ``ExampleHiddenStatesConnector`` copies the states out through pinned memory and polls a CUDA
    event; on the CPU build ``torch.empty_like(..., pin_memory=True)`` raises (no pinned allocator) and the CPU
    worker's event placeholder has no ``query``. When the cache lives in host memory there is nothing to copy
    asynchronously: gather the request's slots and write the file at once. On a GPU the parent's path runs."""
    import torch
    from safetensors.torch import save_file
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
        extract_from_kv_cache,
    )

    class _Written:
        """Stands in for the copy-done event: the file is complete when it is recorded."""

        def query(self) -> bool:
            return True

    class HiddenStatesFileConnector(ExampleHiddenStatesConnector):
        def _submit_async_write(self, pending: Any) -> None:
            if not self._is_tp_rank_zero or self._kv_cache.device.type != "cpu":
                return super()._submit_async_write(pending)
            blocks = torch.tensor(pending.block_ids, dtype=torch.long)
            slots = (torch.arange(self._block_size) + blocks[:, None] * self._block_size).flatten()
            states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            lock = self._lock_fds.pop(pending.req_id, None)
            try:
                save_file({"hidden_states": states, "token_ids": pending.token_ids.clone()}, pending.filename)
            finally:
                if lock is not None:
                    os.close(lock)  # releases the reader waiting in load_hidden_states
            self._req_copy_events[pending.req_id] = _Written()

    return HiddenStatesFileConnector
