"""Online features (train.features: online): extract stores nothing, train computes each shard's states with the
verifier while it trains, and gets the bytes, the plan and the weights an offline run gets."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
import yaml
from mlflow import MlflowClient
from safetensors.torch import load_file

import expman.training.train as train_module
from expman import paths
from expman.data.extract import extract, load_shard
from expman.data.features import FeatureStore
from expman.drafter.objective import Packed
from expman.errors import ExpmanError
from expman.params import load_params
from expman.paths import ExtractPaths, TrainPaths
from expman.training.batches import BatchFeed, _document, batch_plan, index_samples
from expman.training.online import OnlineFeatures, online_chunks, online_refs
from expman.training.train import train
from tests.test_pipeline import run_until


def _set(section: str, **values) -> None:
    params = yaml.safe_load(Path("params.yaml").read_text())
    params.setdefault(section, {}).update(values)
    Path("params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def _extract() -> dict:
    return extract(load_params("params.yaml"), ExtractPaths.default())


def _train() -> dict:
    return train(load_params("params.yaml").train, TrainPaths.default())


def _store_files() -> dict[str, int]:
    root = FeatureStore.default().root
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def _weights() -> dict[str, torch.Tensor]:
    return load_file(str(paths.DRAFTER / "model.safetensors"))


def _clear_train_outputs(project: Path) -> None:
    for folder in (paths.DRAFTER, paths.TRAIN_STATE, paths.TRAIN_PLOTS):
        shutil.rmtree(project / folder, ignore_errors=True)


def test_online_shards_are_the_stored_shards(project: Path) -> None:
    """Every online shard holds the tensors of the offline shard of the same index, bit for bit, and the documents
    are listed in the same order; extract with online features writes no feature."""
    run_until("extract")
    offline = json.loads((paths.EXTRACT / "manifest.json").read_text())
    stored = [load_shard(offline, index) for index in range(len(offline["shards"]))]
    before = _store_files()

    _set("train", features="online")
    manifest = _extract()
    assert manifest["features"] == {"mode": "online"} and "shards" not in manifest
    assert manifest["contract"] == offline["contract"] and manifest["totals"] == offline["totals"]
    assert manifest["storage"] == {"bytes": 0} and _store_files() == before

    chunks = online_chunks(manifest, paths.GENERATED)
    assert online_refs(chunks) == index_samples(offline)
    reader = OnlineFeatures(manifest, chunks, paths.VERIFIER, "cpu", cache_gib=0)
    try:
        for index, tensors in enumerate(stored):
            computed = reader.read(index).result()
            assert computed.keys() == tensors.keys()
            for name, tensor in tensors.items():
                assert computed[name].dtype == tensor.dtype and torch.equal(computed[name], tensor), (index, name)
    finally:
        reader.close()


def test_online_training_equals_offline_training(project: Path) -> None:
    """Same features, same plan: the drafter trained online has the offline drafter's weights and curves, the
    states were computed from the responses (an input of the run), and no feature was written."""
    run_until("vocab")
    _train()
    offline_weights = _weights()
    offline_curve = (paths.TRAIN_PLOTS / "steps.csv").read_text()
    _clear_train_outputs(project)

    _set("train", features="online")
    _extract()
    before = _store_files()
    manifest = _train()
    assert _store_files() == before
    assert "generate" in manifest["upstream"]
    online_weights = _weights()
    assert online_weights.keys() == offline_weights.keys()
    for name, tensor in offline_weights.items():
        assert torch.equal(online_weights[name], tensor), name
    assert (paths.TRAIN_PLOTS / "steps.csv").read_text() == offline_curve
    run = manifest["provenance"]["mlflow_run_id"]
    tokens = MlflowClient().get_metric_history(run, "online_features_tokens")
    assert tokens and tokens[-1].value > 0


def test_the_host_cache_computes_each_shard_once(project: Path) -> None:
    """Without the cache every read computes (every epoch and its held-out pass: more than the samples'
    tokens); with the default room, each shard is computed once."""
    run_until("vocab")
    _set("train", features="online", online_cache_gib=0)
    manifest = _extract()
    total = manifest["totals"]["tokens"]
    run = _train()["provenance"]["mlflow_run_id"]
    assert MlflowClient().get_metric_history(run, "online_features_tokens")[-1].value > total
    _clear_train_outputs(project)
    params = yaml.safe_load(Path("params.yaml").read_text())
    del params["train"]["online_cache_gib"]
    Path("params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    run = _train()["provenance"]["mlflow_run_id"]
    assert MlflowClient().get_metric_history(run, "online_features_tokens")[-1].value == total
    assert MlflowClient().get_metric_history(run, "online_held_out_bytes")[-1].value > 0


def test_validation_reads_the_held_out_documents_training_kept(project: Path) -> None:
    """With room for the held-out documents only, validation reads them as training computed them (the same
    tensors) and computes nothing; with no room, it computes their shards again."""
    run_until("vocab")
    _set("train", features="online")
    manifest = _extract()
    chunks = online_chunks(manifest, paths.GENERATED)
    refs = online_refs(chunks)
    held_out = refs[::3]
    everything = OnlineFeatures(manifest, chunks, paths.VERIFIER, "cpu", cache_gib=0)
    try:
        shards = [everything.read(shard).result() for shard in range(len(chunks))]
    finally:
        everything.close()
    per_token = sum(t[0].numel() * t.element_size() for name, t in shards[0].items() if name != "sample_offsets")
    offsets = sum(8 * (len(chunks[shard]) + 1) for shard in {ref.shard for ref in held_out})
    room = sum(ref.length * per_token for ref in held_out) + offsets

    reader = OnlineFeatures(manifest, chunks, paths.VERIFIER, "cpu", cache_gib=room / 2**30, held_out=held_out)
    try:
        for shard in range(len(chunks)):  # the training pass
            reader.read(shard).result()
        computed = reader.computed_tokens
        validation = reader.held_out()
        for ref in held_out:
            document = _document(validation.read(ref.shard).result(), ref, 10**6)
            expected = _document(shards[ref.shard], ref, 10**6)
            assert all(torch.equal(document[name], expected[name]) for name in expected), ref
        assert reader.computed_tokens == computed and not reader.cache and reader.held_bytes == room
    finally:
        reader.close()

    no_room = OnlineFeatures(manifest, chunks, paths.VERIFIER, "cpu", cache_gib=0, held_out=held_out)
    try:
        no_room.read(0).result()
        no_room.held_out().read(0).result()
        assert no_room.computed_tokens == 2 * int(shards[0]["input_ids"].numel())
    finally:
        no_room.close()


def test_a_killed_online_train_resumes_bit_identical(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_until("vocab")
    _set("train", features="online")
    _extract()
    _train()
    uninterrupted = _weights()
    _clear_train_outputs(project)

    real = train_module.ttt_loss
    calls = []

    def crash(*args, **kwargs):
        calls.append(1)
        if len(calls) == 9:  # in epoch 1, past a checkpoint (states are saved every 3 steps)
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(train_module, "ttt_loss", crash)
    with pytest.raises(KeyboardInterrupt):
        _train()
    assert not (project / paths.DRAFTER).exists()
    monkeypatch.setattr(train_module, "ttt_loss", real)
    _train()
    resumed = _weights()
    for name, tensor in uninterrupted.items():
        assert torch.equal(resumed[name], tensor), name


def test_train_refuses_features_of_the_other_kind(project: Path) -> None:
    run_until("vocab")
    _set("train", features="online")
    with pytest.raises(ExpmanError, match=r"^train.features: online, but data/extract/manifest.json records offline"):
        _train()
    _extract()
    _set("train", features="offline")
    with pytest.raises(ExpmanError, match=r"^train.features: offline, but .* records online features; rerun dvc"):
        _train()
    assert not paths.DRAFTER.exists()


def test_changed_responses_are_refused_by_name(project: Path) -> None:
    run_until("vocab")
    _set("train", features="online")
    manifest = _extract()
    manifest["plan"]["samples_sha256"] = "0" * 64
    with pytest.raises(ExpmanError, match="the responses differ from those data/extract/manifest.json planned"):
        online_chunks(manifest, paths.GENERATED)


def test_doctor_counts_no_feature_bytes_online(project: Path) -> None:
    from expman.doctor import check_disk

    _set("train", features="online")
    [finding] = check_disk(load_params("params.yaml"))
    assert (finding.level, finding.message) == ("ok", "train.features: online: extract stores no features")


def test_the_baseline_follows_train_features(project: Path) -> None:
    _set("baseline", train={"epochs": 1, "features": "online"})
    with pytest.raises(
        ExpmanError, match="^params.yaml: baseline.train: features is not set here: the baseline follows"
    ):
        load_params("params.yaml")


class _Computed:
    """A feature reader over shards already computed (the feed's packing compared alone)."""

    def __init__(self, shards: dict[int, dict[str, torch.Tensor]]):
        self.shards = shards

    def read(self, shard: int) -> Future:
        future: Future = Future()
        future.set_result(self.shards[shard])
        return future

    def close(self) -> None:
        pass


@pytest.mark.gpu
def test_on_cuda_online_states_stay_on_the_gpu_and_pack_as_host_ones(project: Path) -> None:
    """On CUDA the verifier's states, ids and mask stay on the GPU and the feed packs them there; the batches equal
    those the feed makes of the same shards through the host (pinned staging, copy to the device)."""
    run_until("vocab")
    _set("train", features="online")
    manifest = _extract()
    chunks = online_chunks(manifest, paths.GENERATED)
    reader = OnlineFeatures(manifest, chunks, paths.VERIFIER, "cuda", cache_gib=0)
    try:
        computed = {shard: reader.read(shard).result() for shard in range(len(chunks))}
    finally:
        reader.close()
    for tensors in computed.values():
        assert all(tensors[name].is_cuda for name in ("aux_hidden_states", "final_hidden_states", "input_ids"))
        assert not tensors["sample_offsets"].is_cuda
    on_host = {shard: {k: v.cpu() for k, v in tensors.items()} for shard, tensors in computed.items()}
    plan = batch_plan(online_refs(chunks), 256, seed=0, epoch=0, window=2)
    on_gpu = list(BatchFeed(_Computed(computed), plan, 256, "cuda"))
    via_host = list(BatchFeed(_Computed(on_host), plan, 256, "cuda"))
    assert len(on_gpu) == len(plan)
    for packed, reference in zip(on_gpu, via_host, strict=True):
        for name in Packed.__dataclass_fields__:
            assert torch.equal(getattr(packed, name), getattr(reference, name)), name


def test_a_preset_cannot_choose_the_features(project: Path) -> None:
    """extract tracks train.features in params.yaml only (DVC needs the key in every preset it lists it for)."""
    Path("presets").mkdir()
    Path("presets/mine.yaml").write_text(yaml.safe_dump({"train": {"features": "online"}}))
    params = yaml.safe_load(Path("params.yaml").read_text())
    Path("params.yaml").write_text(yaml.safe_dump({"preset": "mine", **params}, sort_keys=False))
    with pytest.raises(ExpmanError, match=r"^presets/mine.yaml: train.features: set it in params.yaml or with -S"):
        load_params("params.yaml")
