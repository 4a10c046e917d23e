"""Wall-clock time of the whole ``expman compare @candidate`` command on a registry of 1,000 versions.

Builds a sqlite MLflow store in a temporary folder through MlflowClient, in process: one evaluate-like run per
version with its own ``evaluation.json`` (48 prompts, k = 1..3, candidate and baseline arms), and 1,000 versions
of one model, each with the tags the register stage writes; aliases baseline (v1), champion (v500) and candidate
(v1000). The versions' sources point at run artifact folders that hold no weights: compare never reads them.
Then it times fresh processes, as a user runs them: ``expman compare @candidate`` (median of 5), ``expman runs``,
``expman --help``, and ``python -c "import mlflow"`` for scale.

  python benchmarks/compare_scale.py --out benchmarks/results/compare_scale.json
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.registry_fixtures: the evaluation.json generator the tests use

from harness import timed, write_report  # noqa: E402

from expman.provenance import package_versions  # noqa: E402
from tests.registry_fixtures import synthetic_evaluation  # noqa: E402

MODEL = "eagle3-smollm2-135m-instruct"


def _sha(index: int) -> str:
    return f"{index:064x}"


def build_store(root: Path, versions: int, prompts: int) -> str:
    """The store described above; returns its tracking URI."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    experiment = client.create_experiment("expman", artifact_location=(root / "mlartifacts").as_uri())
    client.create_registered_model(MODEL)
    baseline = synthetic_evaluation({"candidate": (_sha(1), 0.3)}, prompts=prompts, seed=1)
    improved = synthetic_evaluation({"baseline": (_sha(1), 0.3), "candidate": (_sha(0), 0.6)}, prompts=prompts)
    for number in range(1, versions + 1):
        result = baseline if number == 1 else improved
        result["arms"]["candidate"]["sha256"] = _sha(number)
        run = client.create_run(experiment, tags={"expman.stage": "evaluate"}, run_name="evaluate")
        folder = root / "mlartifacts" / run.info.run_id / "artifacts"
        folder.mkdir(parents=True)
        (folder / "evaluation.json").write_text(json.dumps(result))
        client.log_metric(run.info.run_id, "candidate/k3/tau", 1.0 + number / versions)
        client.set_terminated(run.info.run_id)
        tags = {
            "expman.drafter.sha256": _sha(number),
            "expman.evaluate.run_id": run.info.run_id,
            "expman.upstream.train.run_id": "c" * 32,
            "expman.upstream.train.manifest_sha256": "d" * 64,
            "expman.upstream.evaluate.run_id": run.info.run_id,
            "expman.contract.aux_layers": "[2, 15, 27]",
            "expman.contract.final_state": "pre_norm",
            "expman.contract.layer_convention": "vllm",
            "expman.contract.verifier.weights_sha256": "e" * 64,
            "git.sha": "f" * 40,
            **{f"expman.metrics.{name}_k{k}": "1.5" for name in ("tau", "speedup") for k in (1, 2, 3)},
        }
        client.create_model_version(MODEL, f"{run.info.artifact_uri}/drafter", run_id=run.info.run_id, tags=tags)
    for alias, number in (("baseline", 1), ("champion", versions // 2), ("candidate", versions)):
        client.set_registered_model_alias(MODEL, alias, str(number))
    return uri


def _time(command: list[str], cwd: Path, env: dict[str, str], repeats: int) -> dict[str, object]:
    def run() -> None:
        done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed: {done.stderr.strip()}")

    timing = timed(run, repeats)
    return {
        "command": " ".join([Path(command[0]).name, *command[1:]]),
        "median_s": timing.median,
        "min_s": min(timing.samples),
        "max_s": max(timing.samples),
        "runs_s": timing.samples,
    }


@click.command()
@click.option("--versions", default=1000, show_default=True)
@click.option("--prompts", default=48, show_default=True, help="prompts per evaluation.json")
@click.option("--repeats", default=5, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=None, help="write the result JSON here")
def main(versions: int, prompts: int, repeats: int, out: Path | None) -> None:
    """Build the store, time the commands, print (and write) the result."""
    expman = str(Path(sys.executable).parent / "expman")
    root = Path(tempfile.mkdtemp(prefix="expman-compare-scale-"))
    try:
        started = time.perf_counter()
        uri = build_store(root, versions, prompts)
        build_s = time.perf_counter() - started
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")} | {"MLFLOW_TRACKING_URI": uri}
        report = subprocess.run(
            [expman, "compare", "@candidate", "--json"], cwd=root, env=env, capture_output=True, text=True, check=True
        )
        row = json.loads(report.stdout)["rows"][-1]
        result = {
            "benchmark": "compare_scale",
            "command": "python benchmarks/compare_scale.py" + (f" --out {out}" if out else ""),
            "store": {
                "backend": "sqlite (MLFLOW_TRACKING_URI, file artifacts)",
                "registered_versions": versions,
                "runs": versions,
                "prompts_per_evaluation": prompts,
                "build_s": build_s,
            },
            "compare_checked": {"version": row["version"], "pairing": row["pairing"], "k": row["k"]},
            "timings": {
                "compare": _time([expman, "compare", "@candidate"], root, env, repeats),
                "runs": _time([expman, "runs"], root, env, repeats),
                "help": _time([expman, "--help"], root, env, repeats),
                "import_mlflow": _time([sys.executable, "-c", "import mlflow"], root, env, 3),
            },
            "goal_s": 2.0,
            "packages": package_versions() | {"sqlalchemy": _version("sqlalchemy"), "numpy": _version("numpy")},
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    write_report(out, result)


def _version(package: str) -> str:
    from importlib import metadata

    return metadata.version(package)


if __name__ == "__main__":
    main()
