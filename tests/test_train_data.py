"""The train stage's data path on small shards written by extract's writer: the plan mixes shards within a window
and is a pure function of (seed, epoch); the feed hands out exactly the planned batches, in order, and refuses a
corrupted shard before any batch of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from expman.data.extract import save_streamed
from expman.data.features import STORE_VARIABLE, FeatureStore, feature_folder
from expman.data.shards import ShardSet
from expman.drafter.objective import Packed
from expman.errors import ExpmanError
from expman.provenance import sha256_json
from expman.training.batches import BatchFeed, ShardReader, batch_plan, index_samples

HIDDEN = 8


@pytest.fixture(autouse=True)
def feature_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's own feature store, where ``write_shards`` publishes its set."""
    monkeypatch.setenv(STORE_VARIABLE, str(tmp_path / "features"))
    return tmp_path / "features"


def write_shards(shards: int, documents: int, set_key: str = "0123456789abcdef") -> dict:
    """An extract manifest over ``shards`` shards of ``documents`` random documents (lengths 3 to 12), published
    as set ``set_key`` in the feature store (``EXPMAN_FEATURE_STORE``)."""
    generator = torch.Generator().manual_seed(0)
    folder = FeatureStore.default().folder(set_key)
    store, entries = ShardSet(folder), []
    for index in range(shards):
        lengths = torch.randint(3, 13, (documents,), generator=generator)
        tokens = int(lengths.sum())
        tensors = {
            "input_ids": torch.randint(0, 50, (tokens,), generator=generator, dtype=torch.int32),
            "loss_mask": torch.rand(tokens, generator=generator) > 0.3,
            "aux_hidden_states": torch.randn(tokens, 3 * HIDDEN, generator=generator).bfloat16(),
            "final_hidden_states": torch.randn(tokens, HIDDEN, generator=generator).bfloat16(),
            "verifier_top1": torch.randint(0, 50, (tokens,), generator=generator, dtype=torch.int32),
            "sample_offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
        }
        ids = [f"s{index}-d{i}" for i in range(documents)]
        key = sha256_json(ids)
        metadata = {"expman": json.dumps({"key": key, "sample_ids": ids})}
        write = lambda tmp, t=tensors, m=metadata: save_streamed(t, tmp, m)  # noqa: E731
        entries.append(store.write(f"shard-{index:05d}.safetensors", key, write, tokens=tokens))
    (folder / "set.json").write_text(json.dumps({"key": set_key, "shards": entries}))
    return {"features": {"key": set_key}, "shards": entries}


def expected(manifest: dict, refs: list, max_tokens: int) -> Packed:
    """The packed batch of ``refs`` read the plain way: whole shard, slice, ``Packed.of``."""
    from safetensors.torch import load_file

    folder = feature_folder(manifest)
    documents = []
    for ref in refs:
        tensors = load_file(str(folder / manifest["shards"][ref.shard]["path"]))
        start = int(tensors["sample_offsets"][ref.index])
        end = min(int(tensors["sample_offsets"][ref.index + 1]), start + max_tokens)
        documents.append({name: tensors[name][start:end] for name in tensors if name != "sample_offsets"})
    return Packed.of(documents)


def test_plan_mixes_a_window_of_shards_and_is_a_function_of_seed_and_epoch(tmp_path: Path) -> None:
    refs = index_samples(write_shards(shards=6, documents=5))
    plan = batch_plan(refs, 24, seed=3, epoch=0, window=3)
    assert sorted((r.shard, r.index) for batch in plan for r in batch) == sorted((r.shard, r.index) for r in refs)
    assert plan == batch_plan(refs, 24, seed=3, epoch=0, window=3)
    assert plan != batch_plan(refs, 24, seed=3, epoch=1, window=3)
    assert max(len({r.shard for r in batch}) for batch in plan) > 1  # a batch draws from several shards
    windows = [{r.shard for r in batch} for batch in plan]
    first_window = set().union(*windows[: next(i for i, w in enumerate(windows) if len(w) > 1) + 1])
    assert len(first_window) <= 3
    assert all(len({r.shard for r in batch}) == 1 for batch in batch_plan(refs, 24, seed=3, epoch=0, window=1))
    assert all(sum(min(r.length, 24) for r in batch) <= 24 or len(batch) == 1 for batch in plan)


@pytest.mark.parametrize("pad_to", [None, 24])
def test_feed_hands_out_the_planned_batches_in_order(tmp_path: Path, pad_to: int | None) -> None:
    manifest = write_shards(shards=5, documents=4)
    plan = batch_plan(index_samples(manifest), 24, seed=0, epoch=0, window=2)
    reader = ShardReader(manifest, threads=2)
    batches = list(BatchFeed(reader, plan, 24, "cpu", pad_to, prefetch=2, resident=2))
    reader.close()
    assert len(batches) == len(plan)
    for refs, batch in zip(plan, batches, strict=True):
        want = expected(manifest, refs, 24)
        if pad_to:
            want = want.padded(pad_to)
        for name in Packed.__dataclass_fields__:
            assert torch.equal(getattr(batch, name), getattr(want, name)), name


def test_a_corrupted_shard_is_refused_before_any_of_its_batches(tmp_path: Path) -> None:
    manifest = write_shards(shards=4, documents=4)
    plan = batch_plan(index_samples(manifest), 24, seed=0, epoch=0, window=1)
    bad = plan[len(plan) // 2][0].shard
    path = feature_folder(manifest) / manifest["shards"][bad]["path"]
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # same size: only the checksum can tell
    path.write_bytes(bytes(data))
    reader = ShardReader(manifest, threads=2)
    handed = []
    with pytest.raises(ExpmanError, match=rf"{path.name}: checksum mismatch"):
        for batch in BatchFeed(reader, plan, 24, "cpu", prefetch=3, resident=4):
            handed.append(batch)
    reader.close()
    first_bad = next(i for i, refs in enumerate(plan) if any(r.shard == bad for r in refs))
    assert len(handed) <= first_bad  # no batch holding a document of the corrupted shard was handed out


@pytest.mark.gpu
def test_feed_stops_its_packer_when_the_consumer_leaves(tmp_path: Path) -> None:
    manifest = write_shards(shards=3, documents=4)
    plan = batch_plan(index_samples(manifest), 24, seed=0, epoch=0)
    reader = ShardReader(manifest, threads=1)
    feed = BatchFeed(reader, plan, 24, "cuda", 24, prefetch=1)
    next(iter(feed))
    feed.close()
    reader.close()
    assert not feed.thread.is_alive()


@pytest.mark.gpu
def test_feed_on_cuda_matches_the_host_batches(tmp_path: Path) -> None:
    """Pinned staging rows, copies on the feed's own stream: the device batches equal the host ones."""
    manifest = write_shards(shards=4, documents=4)
    plan = batch_plan(index_samples(manifest), 24, seed=0, epoch=0, window=2)
    reader = ShardReader(manifest, threads=2)
    for refs, batch in zip(plan, BatchFeed(reader, plan, 24, "cuda", 24), strict=True):
        want = expected(manifest, refs, 24).padded(24)
        for name in Packed.__dataclass_fields__:
            assert torch.equal(getattr(batch, name).cpu(), getattr(want, name)), name
    reader.close()
