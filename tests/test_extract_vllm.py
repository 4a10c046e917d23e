"""extract.backend vllm: the serving engine's hidden states against transformers' on the real SmolLM2 (slow; needs
`.[engine]`). Same token ids, both in fp32, both stored as the extract contract's bf16 shards."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from expman import paths
from expman.data.extract import extract, load_shard
from expman.data.generate import generate
from expman.data.verifier import load_verifier_head, prepare
from expman.paths import ExtractPaths, GeneratePaths
from tests.conftest import make_tiny_verifier, real_smollm2_params, tiny_params, write_params, write_prompts


def _shards(manifest: dict) -> dict:
    import torch

    loaded = [load_shard(manifest, i) for i in range(len(manifest["shards"]))]
    return {key: torch.cat([shard[key] for shard in loaded]) for key in loaded[0] if key != "sample_offsets"}


@pytest.mark.slow
def test_vllm_states_match_transformers_on_smollm2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm")
    import torch

    monkeypatch.chdir(tmp_path)
    # the responses come from transformers: vLLM's compile warmup on CPU would outlast these 8 short ones
    params = real_smollm2_params(
        tmp_path, {"train": 8}, datasets=[{"path": "prompts/train.jsonl"}], max_new_tokens=48, backend="hf"
    )
    manifests = {}
    for backend in ("hf", "vllm"):
        # fp32 (dtype auto is bf16 on a CPU with AVX512-BF16): in bf16 the two engines' kernels round differently,
        # min cosine 0.9965 at aux 15 measured on this test's tokens, which is what parity_min_cosine allows for
        section = {"backend": backend, "samples_per_shard": 3, "dtype": "float32"}
        params["extract"].update(section)
        loaded = write_params(params)
        if backend == "hf":
            prepare(loaded, paths.VERIFIER)
            generate(loaded, GeneratePaths(paths.VERIFIER, paths.GENERATED, paths.GENERATE_STATE))
        out = Path(f"extract-{backend}")
        manifests[backend] = extract(loaded, ExtractPaths(paths.VERIFIER, paths.GENERATED, out))
    hf, vllm = manifests["hf"], manifests["vllm"]
    assert (hf["backend"], vllm["backend"]) == ("hf", "vllm")
    assert hf["features"]["key"] != vllm["features"]["key"]  # each backend's own set: the comparison can fail
    assert vllm["engine"].startswith("vllm") and hf["contract"] == vllm["contract"]
    assert hf["totals"] == vllm["totals"]
    a, b = _shards(hf), _shards(vllm)
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
    hidden = hf["contract"]["verifier"]["hidden_size"]
    layers = {
        f"aux {i}": (a["aux_hidden_states"], b["aux_hidden_states"], slice(n * hidden, (n + 1) * hidden))
        for n, i in enumerate(hf["contract"]["aux_layers"])
    }
    layers["final"] = (a["final_hidden_states"], b["final_hidden_states"], slice(None))
    measured = {}
    for name, (x, y, columns) in layers.items():
        x, y = x[:, columns].float(), y[:, columns].float()
        cosine = torch.nn.functional.cosine_similarity(x, y, dim=-1).min().item()
        worst = ((x - y).abs().max() / x.abs().max()).item()
        measured[name] = {"min_cosine": cosine, "max_abs_over_max": worst}
        assert cosine > 0.9999 and worst < 0.01, (name, measured[name])
    differ = (a["verifier_top1"] != b["verifier_top1"]).nonzero().flatten()
    if len(differ):  # only at ties: the two tokens' logits (from transformers' final states) nearly equal
        norm, lm_head = load_verifier_head(paths.VERIFIER, "cpu", torch.float32)
        with torch.no_grad():
            logits = lm_head(norm(a["final_hidden_states"][differ].float()))
        picked = logits.gather(1, torch.stack([a["verifier_top1"][differ], b["verifier_top1"][differ]], 1).long())
        assert (picked[:, 0] - picked[:, 1]).abs().max() < 0.05, picked
    print(json.dumps({"tokens": len(a["input_ids"]), "top1_differ": len(differ), **measured}))


@pytest.mark.slow
def test_two_tensor_parallel_ranks_write_the_states_one_rank_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """extract.tensor_parallel_size 2 on CPU: vLLM shards the verifier over two worker processes of one core each
    (SmolLM2's 9 heads do not split in two, so a random 4-head verifier with vLLM CPU's smallest head size)."""
    pytest.importorskip("vllm")
    import torch

    if (os.cpu_count() or 1) < 2:
        pytest.skip("two tensor-parallel ranks need two cores")
    monkeypatch.chdir(tmp_path)
    make_tiny_verifier(tmp_path / "tiny-verifier", hidden_size=128)
    (tmp_path / "prompts").mkdir()
    write_prompts(tmp_path / "prompts", "train", 8)
    params = tiny_params("tiny-verifier")
    params["generate"].update(datasets=[{"path": "prompts/train.jsonl", "split": "train"}], max_new_tokens=24)
    shards, keys = {}, {}
    for ranks in (1, 2):
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "")  # restored after the test; expman binds per rank
        monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
        section = {"backend": "vllm", "tensor_parallel_size": ranks, "dtype": "float32"}
        params["extract"].update(section)
        loaded = write_params(params)
        if ranks == 1:
            prepare(loaded, paths.VERIFIER)
            generate(loaded, GeneratePaths(paths.VERIFIER, paths.GENERATED, paths.GENERATE_STATE))
        manifest = extract(loaded, ExtractPaths(paths.VERIFIER, paths.GENERATED, Path(f"extract-{ranks}")))
        keys[ranks] = manifest["features"]["key"]
        shards[ranks] = _shards(manifest)
    assert keys[1] != keys[2]  # each rank count computed its own set: the comparison can fail
    one, two = shards[1], shards[2]
    assert torch.equal(one["input_ids"], two["input_ids"]) and len(one["input_ids"]) > 100
    for key in ("aux_hidden_states", "final_hidden_states"):
        x, y = one[key].float(), two[key].float()
        assert torch.nn.functional.cosine_similarity(x, y, dim=-1).min() > 0.9999, key
    assert (one["verifier_top1"] == two["verifier_top1"]).float().mean() > 0.99


@pytest.mark.slow
def test_vllm_online_states_equal_vllm_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """train.features: online with extract.backend: vllm: the engine computes each shard as the trainer reads it,
    and hands out the states offline extraction stores (same engine, same shards)."""
    pytest.importorskip("vllm")
    import torch

    from expman.training.online import OnlineFeatures, online_chunks

    monkeypatch.chdir(tmp_path)
    make_tiny_verifier(tmp_path / "tiny-verifier", hidden_size=128)
    (tmp_path / "prompts").mkdir()
    write_prompts(tmp_path / "prompts", "train", 6)
    params = tiny_params("tiny-verifier")
    params["generate"].update(datasets=[{"path": "prompts/train.jsonl", "split": "train"}], max_new_tokens=24)
    params["extract"].update(backend="vllm", dtype="float32", samples_per_shard=4)
    loaded = write_params(params)
    prepare(loaded, paths.VERIFIER)
    generate(loaded, GeneratePaths(paths.VERIFIER, paths.GENERATED, paths.GENERATE_STATE))
    offline = extract(loaded, ExtractPaths(paths.VERIFIER, paths.GENERATED, Path("extract-offline")))
    params["train"]["features"] = "online"
    online = extract(write_params(params), ExtractPaths(paths.VERIFIER, paths.GENERATED, Path("extract-online")))
    assert online["features"] == {"mode": "online"} and online["contract"] == offline["contract"]
    chunks = online_chunks(online, paths.GENERATED)
    assert len(chunks) == len(offline["shards"]) > 1
    reader = OnlineFeatures(online, chunks, paths.VERIFIER, "cpu", cache_gib=0)
    try:
        for index in range(len(chunks)):
            computed, stored = reader.read(index).result(), load_shard(offline, index)
            assert computed.keys() == stored.keys()
            for name, tensor in stored.items():
                assert torch.equal(computed[name], tensor), (index, name)
    finally:
        reader.close()
