"""Which feature sets the repository still needs: ``expman features`` and ``expman features gc``.

The extract manifest is committed with git (dvc.yaml: ``cache: false``), so every commit, branch and DVC experiment
(``refs/exps/...``) names the key of the set it was trained on. A set that no commit of any ref, nor the workspace,
names is an orphan; ``gc`` removes orphans that no running stage holds (``FeatureStore.remove``).
"""

from __future__ import annotations

import json
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any

from expman import paths
from expman.data.features import FeatureStore
from expman.data.shards import readable_size
from expman.project import project_root
from expman.registry.tables import text_table

__all__ = ["collect_garbage", "list_sets", "references", "render_sets"]

MANIFEST = (paths.EXTRACT / "manifest.json").as_posix()
NAMED_REFS = ("refs/heads", "refs/remotes", "refs/tags", "refs/exps")


def _git(root: Path, *args: str) -> str:
    result = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    return result.stdout if result.returncode == 0 else ""


def _key(text: str) -> str | None:
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError:
        return None
    return ((manifest.get("features") or {}).get("key")) if isinstance(manifest, dict) else None


def _ref_name(ref: str) -> str:
    """A branch, tag or remote branch as git shows it; an experiment by its name."""
    if ref.startswith("refs/exps/"):
        return f"exp {ref.rsplit('/', 1)[-1]}"
    return ref.removeprefix("refs/heads/").removeprefix("refs/tags/").removeprefix("refs/remotes/")


def references(root: Path | None = None) -> dict[str, list[str]]:
    """Per feature key, what names it: ``workspace``, the refs whose tip names it, and (short sha) every other commit
    of any ref that does."""
    root = root or project_root()
    named: dict[str, list[str]] = defaultdict(list)
    workspace = root / MANIFEST
    if workspace.is_file() and (key := _key(workspace.read_text(encoding="utf-8"))):
        named[key].append("workspace")
    tips: dict[str, list[str]] = defaultdict(list)
    for line in _git(root, "for-each-ref", "--format=%(objectname) %(refname)", *NAMED_REFS).splitlines():
        sha, ref = line.split(" ", 1)
        tips[sha].append(_ref_name(ref))
    commits = _git(root, "log", "--all", "--format=%H", "--", MANIFEST).split()
    for sha in dict.fromkeys([*tips, *commits]):
        key = _key(_git(root, "show", f"{sha}:{MANIFEST}"))
        if key:
            named[key].extend(tips.get(sha) or [sha[:9]])
    return {key: list(dict.fromkeys(names)) for key, names in named.items()}


def list_sets(store: FeatureStore | None = None, root: Path | None = None) -> list[dict[str, Any]]:
    """Every set in the store with its size, tokens, verifier, creation time and what references it."""
    store = store or FeatureStore.default()
    named = references(root)
    listed = []
    for entry in store.sets():
        listed.append(
            {
                "key": entry["key"],
                "bytes": entry["bytes"],
                "tokens": entry.get("tokens"),
                "verifier": entry.get("verifier", ""),
                "created": entry.get("created", ""),
                "partial": entry.get("partial", False),
                "referenced_by": named.get(entry["key"], []),
            }
        )
    return listed


def render_sets(listed: list[dict[str, Any]], store: FeatureStore) -> str:
    rows = [["key", "size", "tokens", "verifier", "created", "referenced by"]]
    for entry in listed:
        state = "partial (a killed extract resumes it)" if entry["partial"] else ""
        rows.append(
            [
                entry["key"],
                readable_size(entry["bytes"]),
                f"{entry['tokens']:,}" if entry["tokens"] is not None else "",
                entry["verifier"],
                entry["created"],
                ", ".join(entry["referenced_by"]) or state or "nothing (gc removes it)",
            ]
        )
    total = sum(e["bytes"] for e in listed)
    return "\n".join([f"feature store {store.root}: {len(listed)} sets, {readable_size(total)}", *text_table(rows)])


def collect_garbage(delete: bool, store: FeatureStore | None = None, root: Path | None = None) -> list[str]:
    """Remove (or, without ``delete``, name) the sets nothing references; one line per set. Partial folders are kept:
    they are a killed extract's progress."""
    store = store or FeatureStore.default()
    lines = []
    for entry in list_sets(store, root):
        if entry["referenced_by"] or entry["partial"]:
            continue
        size = readable_size(entry["bytes"])
        if not delete:
            lines.append(f"would remove {entry['key']} ({size})")
        elif store.remove(entry["key"]):
            lines.append(f"removed {entry['key']} ({size})")
        else:
            lines.append(f"kept {entry['key']} ({size}): a running stage holds it")
    return lines
