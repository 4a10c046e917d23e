"""Which project a stage runs in, seen from any of its workspaces.

``dvc exp run --queue`` / ``--temp`` and ``dvc queue start`` run an experiment in a temporary copy of the repository
under ``<project>/.dvc/tmp/exps/``, deleted when the experiment ends. What must outlive that copy (the MLflow store,
the feature store) resolves through ``project_root`` to the project the copy was made from.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["project_root"]

EXPERIMENT_WORKSPACES = (".dvc", "tmp", "exps")  # where DVC puts an experiment's temporary copy of the repository


def project_root(folder: Path | None = None) -> Path:
    """The project a folder belongs to: for a folder inside ``<project>/.dvc/tmp/exps/``, ``<project>``; else the
    folder itself (stages run from their workspace's root)."""
    folder = (folder or Path.cwd()).resolve()
    parts = folder.parts
    width = len(EXPERIMENT_WORKSPACES)
    for start in range(len(parts) - width, 0, -1):  # the innermost match: a project may itself live in such a copy
        if parts[start : start + width] == EXPERIMENT_WORKSPACES:
            return Path(*parts[:start])
    return folder
