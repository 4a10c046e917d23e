"""The vLLM generation backend gives the same greedy tokens as the HF backend (slow; needs `.[engine]`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from expman import paths
from expman.data.generate import generate, read_responses
from expman.data.verifier import prepare
from expman.paths import GeneratePaths
from tests.conftest import real_smollm2_params, write_params


@pytest.mark.slow
def test_vllm_and_hf_backends_agree_on_smollm2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm")
    monkeypatch.chdir(tmp_path)
    # fp32: equal greedy tokens is an fp32 property; in bf16 the two engines' kernels flip near-ties apart
    params = real_smollm2_params(
        tmp_path, {"train": 6}, datasets=[{"path": "prompts/train.jsonl"}], max_new_tokens=48, dtype="float32"
    )
    outputs = {}
    for backend in ("hf", "vllm"):
        params["generate"]["backend"] = backend
        loaded = write_params(params)
        if backend == "hf":
            prepare(loaded, paths.VERIFIER)
        generate(loaded, GeneratePaths(paths.VERIFIER, paths.GENERATED / backend, paths.GENERATE_STATE / backend))
        outputs[backend] = {r["id"]: r for r in read_responses(paths.GENERATED / backend, "train")}
    assert outputs["hf"].keys() == outputs["vllm"].keys()
    for record_id, hf in outputs["hf"].items():
        vllm = outputs["vllm"][record_id]
        assert vllm["prompt_tokens"] == hf["prompt_tokens"], record_id  # the same chat template ids
        assert vllm["input_ids"] == hf["input_ids"], json.dumps([record_id, hf["messages"][-1]])


@pytest.mark.slow
def test_vllm_sampled_responses_are_seeded_per_conversation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampled copies through vLLM CPU: each differs from the greedy response, and a second run (another engine)
    samples exactly the same tokens, because every request carries its own seed."""
    pytest.importorskip("vllm")
    monkeypatch.chdir(tmp_path)
    params = real_smollm2_params(
        tmp_path,
        {"train": 6},
        datasets=[{"path": "prompts/train.jsonl"}],
        max_new_tokens=32,
        backend="vllm",
        sampled_responses=1,
    )
    loaded = write_params(params)
    prepare(loaded, paths.VERIFIER)
    runs = []
    for name in ("first", "second"):
        generate(loaded, GeneratePaths(paths.VERIFIER, paths.GENERATED / name, paths.GENERATE_STATE / name))
        runs.append({r["id"]: r["input_ids"] for r in read_responses(paths.GENERATED / name, "train")})
    assert runs[0] == runs[1]
    originals = [i for i in runs[0] if "~" not in i]
    assert len(runs[0]) == 2 * len(originals) == 12
    assert sum(runs[0][i] != runs[0][f"{i}~s1"] for i in originals) >= 4
