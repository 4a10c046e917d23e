"""Every committed result names its commit, command, date, CPU (model and flags) and packages, or says under
``provenance: incomplete`` which of them it lacks (and whether it was assembled by hand); a report written by
benchmarks/harness.py has them all, so a new result passes without a marker."""

from __future__ import annotations

import importlib
import json
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = sorted((REPO / "benchmarks/results").glob("*.json"))


@pytest.fixture
def harness(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))  # as the scripts import it, run from benchmarks/
    return importlib.import_module("harness")


def test_there_are_results() -> None:
    assert len(RESULTS) > 10


@pytest.mark.parametrize("path", RESULTS, ids=[p.name for p in RESULTS])
def test_a_result_has_its_provenance_or_says_what_it_lacks(path: Path, harness) -> None:
    """A marked result lists every missing key (an entry may explain it: ``packages (only free text)``); an
    unmarked one lacks none."""
    report = json.loads(path.read_text())
    missing = harness.provenance_missing(report)
    if "provenance" not in report:
        assert not missing, f"{path.name} lacks {missing}: record them or mark it provenance: incomplete"
        assert "provenance_missing" not in report
        return
    assert report["provenance"] == "incomplete"
    listed = report["provenance_missing"]
    assert isinstance(listed, list) and listed and all(isinstance(entry, str) and entry for entry in listed)
    unlisted = [key for key in missing if not any(e == key or e.startswith(key + " ") for e in listed)]
    assert not unlisted, f"{path.name}: provenance_missing does not name {unlisted}"


def test_provenance_missing_counts_empty_values_as_missing(harness) -> None:
    full = {
        "git_commit": "abc",
        "command": "python x.py",
        "date": "2026-12-07T10:00:00+00:00",
        "machine": {"cpu": "AMD EPYC", "cpu_flags": []},
        "packages": {"torch": "2.13.0"},
    }
    assert harness.provenance_missing(full) == []
    assert harness.provenance_missing(full | {"git_commit": None, "machine": "2-core AMD EPYC"}) == [
        "commit",
        "machine.cpu",
        "machine.cpu_flags",
    ]
    assert harness.provenance_missing({"commit": "abc", "commands": {"a": "x"}, "packages": "torch 2.11"}) == [
        "date",
        "machine.cpu",
        "machine.cpu_flags",
        "packages",
    ]


def test_a_report_written_by_the_harness_passes(tmp_path: Path, harness, monkeypatch) -> None:
    """write_report records commit, dirty flag, command, date (UTC), CPU, flags, threads, GPUs and packages."""
    monkeypatch.setattr("sys.argv", ["bench.py", "--out", "x.json"])
    out = tmp_path / "bench.json"
    harness.write_report(out, harness.header("bench") | {"value": 1.5})
    report = json.loads(out.read_text())
    assert harness.provenance_missing(report) == [] and "provenance" not in report
    assert report["command"] == "python bench.py --out x.json"
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    if head.returncode == 0:  # a checkout: the commit is HEAD's
        assert report["git_commit"] == head.stdout.strip() and isinstance(report["git_dirty"], bool)
    date = datetime.fromisoformat(report["date"])
    assert date.utcoffset().total_seconds() == 0 and abs((datetime.now(UTC) - date).total_seconds()) < 600
    machine = report["machine"]
    assert machine["cpu"] and isinstance(machine["cpu_flags"], list) and machine["torch_threads"] >= 1
    assert {"gpu", "gpu_count"} <= machine.keys()
    assert "torch" in report["packages"]


def test_a_report_made_away_from_the_machine_keeps_the_measuring_runs_commit(tmp_path: Path, harness) -> None:
    """With machine=False (a report merged elsewhere) the commit and date already there stay; absent ones fill in."""
    out = tmp_path / "merged.json"
    measured = {"benchmark": "b", "command": "c", "git_commit": "0" * 40, "git_dirty": False, "date": "2026-12-01"}
    harness.write_report(out, measured, machine=False)
    report = json.loads(out.read_text())
    assert {key: report[key] for key in measured} == measured and "machine" not in report
    harness.write_report(out, {"benchmark": "b"}, machine=False)
    assert json.loads(out.read_text())["date"]  # filled in


def test_device_calls_are_summed_by_the_scripts_own_clock(tmp_path: Path, harness) -> None:
    """A report spanning device calls records their seconds as measured, beside any typed device_seconds."""
    out = tmp_path / "gpu.json"
    calls = [{"command": ["dvc", "exp", "run"], "seconds": 533.5}, {"command": ["dvc"], "seconds": 458.25}]
    harness.write_report(out, {"device_seconds": 1179.0, "calls": calls}, machine=False)
    report = json.loads(out.read_text())
    assert report["device_call_seconds"] == 991.75 and report["device_seconds"] == 1179.0
    assert harness.calls_seconds([]) is None and harness.calls_seconds([{"command": "x"}]) is None


def test_outside_a_checkout_the_commit_is_the_named_one_or_none(tmp_path: Path, harness, monkeypatch) -> None:
    """A device machine's copy of the tree has no .git: the commit is BENCH_GIT_COMMIT or None, never guessed."""
    monkeypatch.delenv("BENCH_GIT_COMMIT", raising=False)
    assert harness.git_state(tmp_path) == {"git_commit": None, "git_dirty": None}
    monkeypatch.setenv("BENCH_GIT_COMMIT", "73703ca")
    assert harness.git_state(tmp_path) == {"git_commit": "73703ca", "git_dirty": None}
