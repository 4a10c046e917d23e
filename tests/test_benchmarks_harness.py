"""benchmarks/harness.py's report writer: every result JSON records where it was measured (machine facts and
package versions), and a report that fails (to serialize, or before its rename) leaves no partial or temporary
file and the earlier report intact."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_report_holds_machine_facts_and_is_written_atomically(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))  # as the scripts import it, run from benchmarks/
    harness = importlib.import_module("harness")
    out = tmp_path / "results/bench.json"
    harness.write_report(out, {"benchmark": "bench", "value": 1.5})
    report = json.loads(out.read_text())
    assert report["benchmark"] == "bench" and report["value"] == 1.5
    machine = report["machine"]
    assert {"cpu", "cpu_flags", "cores", "torch_threads", "gpu", "gpu_count", "platform", "python"} <= machine.keys()
    assert machine["cpu"] and machine["torch_threads"] >= 1
    assert {"torch", "transformers"} <= report["packages"].keys()

    with pytest.raises(TypeError):
        harness.write_report(out, {"benchmark": "bench", "value": object()})
    assert json.loads(out.read_text())["value"] == 1.5  # the earlier report is intact
    assert [p.name for p in out.parent.iterdir()] == ["bench.json"]  # no temp file left

    def interrupted(*_: object) -> None:
        raise OSError("killed before the rename")

    with monkeypatch.context() as patch, pytest.raises(OSError):
        patch.setattr(os, "replace", interrupted)
        harness.write_report(out, {"benchmark": "bench", "value": 2.5})
    assert json.loads(out.read_text())["value"] == 1.5
    assert [p.name for p in out.parent.iterdir()] == ["bench.json"]

    fresh = tmp_path / "fresh.json"
    with pytest.raises(TypeError):
        harness.write_report(fresh, {"value": {1, 2}})
    assert not fresh.exists()
