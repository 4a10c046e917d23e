"""Resumable shard folders: a shard is done only when its sidecar carries the shard's plan key and its size matches.

Writers call ``ShardSet.write`` (atomic file, then sidecar with sha256), so a kill leaves at most one shard
to redo. Readers call ``verify_shard`` with the manifest's entry, so a corrupted or foreign shard is caught.
"""

from __future__ import annotations

import glob
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from expman.errors import ExpmanError
from expman.provenance import atomic_write, atomic_write_json, sha256_file

__all__ = ["ShardSet", "remove_stale_temps", "verify_shard"]


class ShardSet:
    """Shards in one folder, each keyed by the digest of what it was planned from (settings + inputs)."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def _sidecar(self, name: str) -> Path:
        return self.folder / f"{name}.done.json"

    def done(self, name: str, key: str) -> dict[str, Any] | None:
        """The sidecar of a completed shard planned as ``key``, or None when it must be (re)written."""
        sidecar, shard = self._sidecar(name), self.folder / name
        if not (sidecar.is_file() and shard.is_file()):
            return None
        try:
            info = json.loads(sidecar.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
        if info.get("key") != key or info.get("bytes") != shard.stat().st_size:
            return None
        return info

    def write(self, name: str, key: str, write: Callable[[Path], str | None], **facts: Any) -> dict[str, Any]:
        """Write one shard atomically, then its sidecar; return the sidecar facts. ``write`` may return the sha256
        of the bytes it wrote (a writer that hashes as it streams); otherwise the file is read back to hash it."""
        shard = self.folder / name
        digest = atomic_write(shard, write)
        info = {
            "path": name,
            "key": key,
            "bytes": shard.stat().st_size,
            "sha256": digest or sha256_file(shard),
            **facts,
        }
        atomic_write_json(self._sidecar(name), info)
        return info

    def remove_others(self, keep: set[str]) -> None:
        """Delete shards and sidecars of earlier plans that the current plan does not contain, and the temp files
        of writes that a kill interrupted."""
        for path in self.folder.iterdir():
            name = path.name.removesuffix(".done.json")
            temp = path.name.startswith(".") and path.name.endswith(".tmp")
            if path.is_file() and (temp or (name not in keep and not path.name.startswith("."))):
                path.unlink()


def readable_size(count: float) -> str:
    """Bytes as people read them: 37.7 GB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count:.0f} B"


def disk_room(folder: Path) -> tuple[int, int]:
    """(bytes free on the disk that holds or will hold ``folder``, bytes of safetensors shards already in it)."""
    existing = sum(p.stat().st_size for p in folder.glob("*.safetensors")) if folder.is_dir() else 0
    volume = folder.absolute()
    while not volume.exists():
        volume = volume.parent
    return shutil.disk_usage(volume).free, existing


def remove_stale_temps(path: Path) -> None:
    """Delete what killed atomic writes of ``path`` left beside it: ``.<name>.*.tmp`` files and folders."""
    for temp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        if temp.is_dir():
            shutil.rmtree(temp)
        else:
            temp.unlink()


def verify_shard(folder: Path, entry: dict[str, Any]) -> Path:
    """Check one manifest entry against the file on disk: present, same size, same sha256."""
    path = folder / entry["path"]
    if not path.is_file():
        raise ExpmanError(f"{path}: shard listed in the manifest is missing")
    if path.stat().st_size != entry["bytes"] or sha256_file(path) != entry["sha256"]:
        raise ExpmanError(f"{path}: checksum mismatch (corrupted, or a shard from another run)")
    return path
