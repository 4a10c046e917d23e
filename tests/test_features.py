"""The feature store's contract: a set is visible only once complete, one writer per key, and gc never removes a set
a stage holds."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from expman.data.features import FeatureStore


def _publish(store: FeatureStore, key: str) -> None:
    with store.writing(key) as shards:
        assert shards is not None
        shards.write("shard-00000.safetensors", "plan", lambda tmp: tmp.write_bytes(b"x" * 10))
        assert store.published(key) is None, "a set being written is not visible"
        store.publish(key, shards, {"tokens": 5, "shards": []})


def test_a_set_is_published_whole_and_listed(tmp_path: Path) -> None:
    store = FeatureStore(tmp_path / "store")
    _publish(store, "k1")
    assert store.published("k1")["tokens"] == 5
    assert not store.partial_folder("k1").exists()
    [listed] = store.sets()
    assert listed["key"] == "k1" and listed["bytes"] > 10


def test_a_second_writer_waits_then_finds_the_key_published(tmp_path: Path) -> None:
    store = FeatureStore(tmp_path / "store")
    seen: list[object] = []
    with store.writing("k1") as shards:
        waiter = threading.Thread(target=lambda: seen.append(store.writing("k1").__enter__()))
        waiter.start()
        time.sleep(0.3)
        assert waiter.is_alive() and not seen, "the second writer waits for the first"
        store.publish("k1", shards, {"shards": []})
    waiter.join(5)
    assert seen == [None], "it then reads the published set instead of computing it"


def test_gc_never_removes_a_set_a_stage_holds(tmp_path: Path) -> None:
    store = FeatureStore(tmp_path / "store")
    _publish(store, "k1")
    with store.using("k1"):
        assert store.remove("k1") is False
        assert store.published("k1") is not None
    assert store.remove("k1") is True
    assert store.published("k1") is None and store.sets() == []
