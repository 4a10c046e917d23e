"""The settings expman gives a vLLM engine on CPU: core binding per tensor-parallel rank, and a KV cache sized to
the work instead of vLLM CPU's 4 GiB (fast: no engine starts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from expman.engines import vllm as engine
from expman.errors import ExpmanError

LLAMA = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 3}


def _verifier(tmp_path: Path, config: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_an_extraction_cache_holds_the_verifier_s_keys_and_values_and_the_captured_states(tmp_path: Path) -> None:
    settings = engine._prefill_kv_cache(_verifier(tmp_path, LLAMA), [2, 3, 1, 3], 300, "bfloat16")
    # per token: keys and values of 3 layers x 2 heads x 16 dims, and 4 captured states of 64, all 2 bytes each
    token_bytes = 2 * 3 * 2 * 16 * 2 + 4 * 64 * 2
    assert settings["max_model_len"] == 512  # 301 tokens (the prompt and the one generated) in 256-token blocks
    assert settings["max_num_batched_tokens"] == engine.PREFILL_STEP_TOKENS
    # two steps' prompts and the longest request, twice over
    assert settings["kv_cache_memory_bytes"] == 2 * 2 * (engine.PREFILL_STEP_TOKENS + 512) * token_bytes


def test_a_prompt_longer_than_a_step_gets_a_step_of_its_own(tmp_path: Path) -> None:
    settings = engine._prefill_kv_cache(_verifier(tmp_path, LLAMA), [1, 2, 3, 3], 9000, "float32")
    assert settings["max_model_len"] == settings["max_num_batched_tokens"] == 9216


def test_mla_and_unknown_attention_leave_the_cache_to_vllm(tmp_path: Path) -> None:
    mla = _verifier(tmp_path, {**LLAMA, "kv_lora_rank": 512})
    assert engine._prefill_kv_cache(mla, [1, 2, 3, 3], 100, "bfloat16") == {}
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    assert engine._prefill_kv_cache(tmp_path, [1, 2, 3, 3], 100, "bfloat16") == {}


@pytest.mark.parametrize(("cores", "ranks", "bind"), [(2, 1, "0-1"), (2, 2, "0-0|1-1"), (16, 4, "0-3|4-7|8-11|12-15")])
def test_each_tensor_parallel_rank_gets_its_own_cores(
    monkeypatch: pytest.MonkeyPatch, cores: int, ranks: int, bind: str
) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.setattr(engine.os, "cpu_count", lambda: cores)
    engine._cpu_defaults(ranks)
    assert engine.os.environ["VLLM_CPU_OMP_THREADS_BIND"] == bind
    assert engine.os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"


def test_the_user_s_binding_wins_and_too_many_ranks_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1|0")
    monkeypatch.setattr(engine.os, "cpu_count", lambda: 2)
    engine._cpu_defaults(2)
    assert engine.os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "1|0"
    with pytest.raises(ExpmanError, match=r"^tensor_parallel_size 4 needs 4 cores on CPU; this machine has 2$"):
        engine._cpu_defaults(4)


def test_expert_parallel_is_refused_on_cpu_before_the_engine_starts(tmp_path: Path) -> None:
    """``device: auto`` on a machine without GPUs gets past the params check; the engine refuses before it starts
    (vLLM CPU 0.32 segfaults in its fused-MoE kernel with expert parallel: measured on a random Qwen3-MoE)."""
    pytest.importorskip("vllm")
    with pytest.raises(ExpmanError, match=r"^extract.expert_parallel needs GPUs"):
        engine.VllmHiddenStates(_verifier(tmp_path, LLAMA), [1, 2, 3, 3], "cpu", "float32", 2, False, 100, True)
    assert not list(tmp_path.glob("expman-states-*"))


def test_an_engine_that_does_not_start_leaves_no_states_folder(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    import tempfile

    shared = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    before = set(shared.glob("expman-states-*"))
    with pytest.raises(Exception, match="model_type|architectures|Unrecognized|config"):  # a config.json without them
        engine.VllmHiddenStates(_verifier(tmp_path, LLAMA), [1, 2, 3, 3], "cpu", "float32", 1, False, 100)
    assert set(shared.glob("expman-states-*")) == before
