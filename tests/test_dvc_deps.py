"""dvc.yaml's code dependencies are complete: each stage lists its script and every expman module the script imports,
directly or not (imports inside functions included: expman imports heavy code lazily), and nothing else of the
code. A code change then reruns exactly the stages whose code changed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def _module_file(name: str) -> Path | None:
    base = REPO / Path(*name.split("."))
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return base.with_suffix(".py") if base.with_suffix(".py").is_file() else None


def _imported(path: Path) -> set[str]:
    """Names of the expman modules (or module attributes) ``path`` imports anywhere in its body."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "expman"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "expman":
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}  # `from expman import paths`
    return found


def import_closure(script: Path) -> set[str]:
    """Every project file that running ``script`` can import: the modules and the packages above them."""
    seen: set[Path] = set()
    todo = [script]
    while todo:
        for name in _imported(todo.pop()):
            parts = name.split(".")
            for depth in range(1, len(parts) + 1):
                found = _module_file(".".join(parts[:depth]))
                if found is not None and found not in seen:
                    seen.add(found)
                    todo.append(found)
    return {path.relative_to(REPO).as_posix() for path in seen}


STAGES = yaml.safe_load((REPO / "dvc.yaml").read_text(encoding="utf-8"))["stages"]


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_each_stage_lists_the_code_it_imports(stage: str) -> None:
    script = f"stages/{stage}.py"
    declared = {dep for dep in STAGES[stage]["deps"] if isinstance(dep, str) and dep.endswith(".py")}
    needed = {script} | import_closure(REPO / script)
    missing, extra = sorted(needed - declared), sorted(declared - needed)
    assert not missing, f"dvc.yaml: stage {stage} imports but does not list: {', '.join(missing)}"
    assert not extra, f"dvc.yaml: stage {stage} lists code it does not import: {', '.join(extra)}"


def test_the_closure_follows_imports_inside_functions() -> None:
    """extract loads vLLM's engine module only inside a function, on extract.backend: vllm."""
    assert "expman/engines/vllm.py" in import_closure(REPO / "stages/extract.py")
    assert "expman/registry/compare.py" not in import_closure(REPO / "stages/prepare.py")
