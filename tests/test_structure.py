"""Project structure rules: the library never imports stages and has no import circle, dvc.yaml writes where
expman.paths says, the CLI starts without the heavy libraries, and ruff's lint and format checks pass."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import yaml

from expman import paths

REPO = Path(__file__).resolve().parents[1]


def test_library_never_imports_stages() -> None:
    for path in (REPO / "expman").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n == "stages" or n.startswith("stages.") for n in names), path


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Each expman module and the expman modules it imports, at the top or inside a function."""
    files = {_module_name(path): path for path in (REPO / "expman").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)  # expman uses absolute imports only
                imported.update(f"{node.module}.{alias.name}" for alias in node.names)
        graph[name] = {module for module in imported if module in files and module != name}
    return graph


def test_no_import_circle() -> None:
    graph = _import_graph()
    assert "expman.data.generate" in graph["expman.evaluation.evaluate"]  # the graph sees the imports
    done: set[str] = set()

    def visit(module: str, chain: list[str]) -> None:
        if module in chain:
            raise AssertionError("import circle: " + " -> ".join([*chain[chain.index(module) :], module]))
        if module not in done:
            for imported in sorted(graph[module]):
                visit(imported, [*chain, module])
            done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_one_module_talks_to_mlflow_and_one_to_vllm() -> None:
    """MLflow runs and registry writes live in registry/tracking.py (the registry reader talks SQL and REST);
    vLLM lives in engines/vllm.py."""
    owners = {"mlflow": {"expman/registry/tracking.py"}, "vllm": {"expman/engines/vllm.py"}}
    found: dict[str, set[str]] = {package: set() for package in owners}
    for path in (REPO / "expman").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            for package in owners:
                if any(m.split(".")[0] == package for m in modules):
                    found[package].add(str(path.relative_to(REPO)))
    assert found == owners


def _imported_names(path: Path) -> list[str]:
    """Every module ``path`` imports (and ``module.name`` for each ``from module import name``)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return names


def test_serving_engines_live_in_the_engines_package_below_data() -> None:
    """Only expman/engines/ imports a serving engine (vllm, sglang): the library, the stages and the benchmarks go
    through it. It imports nothing of expman.data: the data stages use the engines, never the reverse."""
    engines = REPO / "expman" / "engines"
    for folder in ("expman", "stages", "benchmarks"):
        for path in (REPO / folder).rglob("*.py"):
            names = _imported_names(path)
            if engines in path.parents:
                assert not [n for n in names if n == "expman.data" or n.startswith("expman.data.")], path
            else:
                assert not [n for n in names if n.split(".")[0] in ("vllm", "sglang")], path


STAGE_MODULES = (  # where each stage's function lives (stages/<stage>.py calls it)
    "data/verifier.py",
    "data/generate.py",
    "data/extract.py",
    "data/vocab.py",
    "training/baseline.py",
    "training/train.py",
    "evaluation/evaluate.py",
    "evaluation/benchmark.py",
    "registry/register.py",
)


def test_stage_functions_read_as_steps() -> None:
    """No function of a stage module runs over 60 lines: a stage is a short list of named steps."""
    for module in STAGE_MODULES:
        for node in ast.walk(ast.parse((REPO / "expman" / module).read_text())):
            if isinstance(node, ast.FunctionDef):
                assert node.end_lineno - node.lineno < 60, f"expman/{module}:{node.lineno} {node.name}"


def test_dvc_outputs_are_the_library_paths() -> None:
    graph = yaml.safe_load((REPO / "dvc.yaml").read_text())
    stages = graph["stages"]
    outs = {
        stage: [next(iter(o)) if isinstance(o, dict) else o for o in spec.get("outs", [])]
        for stage, spec in stages.items()
    }
    assert outs["prepare"] == [str(paths.VERIFIER)]
    assert outs["generate"] == [str(paths.GENERATED)]
    assert outs["extract"] == [str(paths.EXTRACT / "manifest.json")]
    assert outs["vocab"] == [str(paths.VOCAB / "vocab.safetensors"), str(paths.VOCAB / "manifest.json")]
    assert outs["train"] == [str(paths.DRAFTER), str(paths.TRAIN_PLOTS)]
    assert stages["train"]["metrics"] == [{str(paths.TRAIN_METRICS): {"cache": False}}]
    assert outs["evaluate"] == [str(paths.EVALUATE), str(paths.EVALUATE_PLOTS)]
    plotted = {Path(file) for plot in graph["plots"] for spec in plot.values() for file in spec["y"]}
    assert {file.parent for file in plotted} == {paths.TRAIN_PLOTS, paths.EVALUATE_PLOTS}
    for folder in (paths.TRAIN_PLOTS, paths.EVALUATE_PLOTS):  # not cached: git keeps them, as it keeps metrics
        assert {str(folder): {"cache": False}} in [o for spec in stages.values() for o in spec.get("outs", [])]
    also_reads = {"extract": ["train.features"]}  # the one exception: online features mean extract computes nothing
    for stage, spec in stages.items():
        declared = [stage, *also_reads.get(stage, []), {"presets/${preset}.yaml": [stage]}]
        assert spec["params"] == declared, "each stage declares only its own section (and its preset's)"
        assert f"stages/{stage}.py" in spec["deps"]
        code = [dep for dep in spec["deps"] if dep.startswith("expman/")]
        assert code and all((REPO / dep).is_file() for dep in code), f"{stage}: {code}"


def test_help_does_not_import_heavy_libraries() -> None:
    code = (
        "import sys; from click.testing import CliRunner; from expman.cli import main; "
        "r = CliRunner().invoke(main, ['--help']); assert r.exit_code == 0; "
        "print(sorted(m for m in ('torch', 'mlflow', 'transformers', 'vllm', 'sqlalchemy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_ci_runs_the_readme_test_command() -> None:
    command = (REPO / ".ci/run").read_text().strip().splitlines()[-1]
    assert command.endswith("&& pytest")
    assert f"```bash\n{command}\n```" in (REPO / "README.md").read_text()


def test_ruff_check_and_format_check_pass() -> None:
    """CI runs the linter and the formatter's check through this test; their output is the failure message."""
    for command in (["check", "."], ["format", "--check", "."]):
        done = subprocess.run([sys.executable, "-m", "ruff", *command], cwd=REPO, capture_output=True, text=True)
        assert done.returncode == 0, f"ruff {' '.join(command)}:\n{done.stdout}{done.stderr}"


def test_ui_binds_loopback_and_the_project_store(tmp_path: Path, monkeypatch) -> None:
    from click.testing import CliRunner

    from expman.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", raising=False)  # serve_ui sets it; undone after
    launched = []
    monkeypatch.setattr(os, "execv", lambda executable, command: launched.append(command))  # never become the server
    assert CliRunner().invoke(main, ["ui"]).exit_code == 0
    command = launched[0]
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert command[command.index("--backend-store-uri") + 1] == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    assert command[command.index("--default-artifact-root") + 1] == (tmp_path.resolve() / "mlartifacts").as_uri()


def test_no_pickle_loads_anywhere() -> None:
    """Weights are safetensors; the one torch.load (train resume state) passes weights_only=True; nothing
    imports pickle or loads numpy pickles."""
    for folder in ("expman", "stages", "benchmarks"):
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                    assert not any(m.split(".")[0] in ("pickle", "dill", "joblib") for m in modules), path
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load":
                    owner = ast.unparse(node.func.value)
                    keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
                    if owner == "torch":
                        assert keywords.get("weights_only") == "True", f"{path}:{node.lineno}"
                    if owner in ("np", "numpy"):
                        assert keywords.get("allow_pickle") in (None, "False"), f"{path}:{node.lineno}"


def test_the_vllm_module_imports_without_vllm_until_its_connector_is_asked_for() -> None:
    """vLLM's connector factory looks ``HiddenStatesFileConnector`` up by name in expman.engines.vllm; importing
    the module (the CLI, every stage) must not import vLLM, and another name is an AttributeError."""
    import subprocess
    import sys

    code = (
        "import sys, expman.engines.vllm as m; assert 'vllm' not in sys.modules; "
        "assert not hasattr(m, 'NoSuchConnector'); assert 'vllm' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
