"""The feature store: extract's shards, published once under a key of what determines them, found by every workspace.

Features are the graph's largest data (828 GB for the team in DESIGN.md), so they live outside DVC and outside any
one workspace. A set is keyed by the digest of what decides its bytes: the capture contract, the prepare and
generate manifests it was computed from (the verifier's weights digest and the responses' checksums are in them),
the extract params and the device and dtype they resolved to. A stage that needs a published key reads it and
computes nothing: a queued or temporary DVC experiment, a teammate's clone, an experiment that changes only
training.

Where: ``EXPMAN_FEATURE_STORE`` when set (a team's shared storage: one setting), else ``<project>/.expman/features``
where ``<project>`` is the main workspace, also from DVC's temporary copies (``expman.project``). Per project and
not the user's cache, so that ``expman features gc`` knows every reference to a set: the commits, branches and
experiments of this repository. A shared store is shared knowingly, by setting the variable.

Layout and locks (``fcntl.flock``, which NFSv4 honours)::

    <store>/<key>/            a published set: shards, their sidecars, set.json (written last, then renamed in)
    <store>/<key>.partial/    a set being written, or left by a kill: the next extract of that key resumes it
    <store>/<key>.write.lock  held by the one extract writing the key; a second one waits, then finds it published
    <store>/<key>.lock        held shared by every stage using the set; ``gc`` removes only a set it can lock alone
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from expman.data.shards import ShardSet
from expman.errors import ExpmanError
from expman.project import project_root
from expman.provenance import atomic_write_json, sha256_json

__all__ = ["STORE_VARIABLE", "FeatureStore", "feature_folder", "feature_key"]

STORE_VARIABLE = "EXPMAN_FEATURE_STORE"
SET_FILE = "set.json"
PARTIAL = ".partial"


def feature_key(contract: dict[str, Any], upstream: dict[str, dict[str, str]], determining: dict[str, Any]) -> str:
    """The key of a feature set: a digest of the contract, the input manifests' digests and the settings that decide
    the bytes (extract params with device and dtype resolved)."""
    inputs = {name: entry["manifest_sha256"] for name, entry in sorted(upstream.items())}
    return sha256_json({"contract": contract, "inputs": inputs, "extract": determining})[:32]


@dataclass(frozen=True)
class FeatureStore:
    """One store folder (see the module's docstring)."""

    root: Path

    @classmethod
    def default(cls) -> FeatureStore:
        """``EXPMAN_FEATURE_STORE``, else ``<project>/.expman/features``."""
        configured = os.environ.get(STORE_VARIABLE)
        return cls(Path(configured).expanduser().resolve() if configured else project_root() / ".expman/features")

    def folder(self, key: str) -> Path:
        return self.root / key

    def partial_folder(self, key: str) -> Path:
        """Where ``key`` is written until it is published (and where a killed extract left it)."""
        return self.root / f"{key}{PARTIAL}"

    def published(self, key: str) -> dict[str, Any] | None:
        """The set.json of a published set, or None."""
        path = self.folder(key) / SET_FILE
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None

    @contextlib.contextmanager
    def using(self, key: str) -> Iterator[None]:
        """Hold the set as in use (shared with other users; ``gc`` will not remove it) for the block."""
        with self._lock(f"{key}.lock", fcntl.LOCK_SH):
            yield

    @contextlib.contextmanager
    def writing(self, key: str) -> Iterator[ShardSet | None]:
        """The shard folder to write ``key`` into, held by this process alone; None when another process published
        the key while this one waited. ``publish`` ends the write."""
        with self._lock(f"{key}.write.lock", fcntl.LOCK_EX):
            yield None if self.published(key) else ShardSet(self.partial_folder(key))

    def publish(self, key: str, shards: ShardSet, facts: dict[str, Any]) -> None:
        """Write set.json into the written folder, then rename the folder to the key: readers see all or nothing."""
        atomic_write_json(shards.folder / SET_FILE, {"key": key, **facts})
        os.replace(shards.folder, self.folder(key))

    def sets(self) -> list[dict[str, Any]]:
        """Every published set's set.json plus its size on disk; and each partial one, marked ``partial``."""
        found = []
        for folder in sorted(self.root.iterdir()) if self.root.is_dir() else []:
            if not folder.is_dir():
                continue
            size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
            if folder.name.endswith(PARTIAL):
                found.append({"key": folder.name.removesuffix(PARTIAL), "partial": True, "bytes": size})
            elif (folder / SET_FILE).is_file():
                found.append({**json.loads((folder / SET_FILE).read_text(encoding="utf-8")), "bytes": size})
        return found

    def remove(self, key: str, partial: bool = False) -> bool:
        """Delete a set (or its partial folder) unless a stage holds it; whether it was deleted."""
        try:
            with (
                self._lock(f"{key}.lock", fcntl.LOCK_EX | fcntl.LOCK_NB),
                self._lock(f"{key}.write.lock", fcntl.LOCK_EX | fcntl.LOCK_NB),
            ):
                shutil.rmtree(self.partial_folder(key) if partial else self.folder(key))
        except BlockingIOError:
            return False
        return True

    @contextlib.contextmanager
    def _lock(self, name: str, mode: int) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / name, "a") as handle:
            fcntl.flock(handle, mode)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)


def feature_folder(manifest: dict[str, Any]) -> Path:
    """The folder of the set an extract manifest names; a set the store lacks is an error that says how to get it."""
    key = manifest["features"]["key"]
    store = FeatureStore.default()
    if not (store.folder(key) / SET_FILE).is_file():
        raise ExpmanError(
            f"features {key}: not in the feature store {store.root} (set {STORE_VARIABLE} to the store that has "
            "them, or compute them again: dvc repro -f extract)"
        )
    return store.folder(key)
