"""benchmarks/harness.py's report writer: every result JSON records where it was measured (machine facts and
package versions), and a report that fails (to serialize, or before its rename) leaves no partial or temporary
file and the earlier report intact. benchmarks/quality_gpu.py run waits for an earlier run that still holds DVC's
lock."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
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


def test_quality_gpu_run_sees_only_live_holders_of_the_dvc_lock(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    quality_gpu = importlib.import_module("quality_gpu")
    monkeypatch.chdir(tmp_path)
    assert quality_gpu.lock_holders() == set()  # no lock file: nobody
    child = subprocess.Popen(["sleep", "60"])
    finished = subprocess.Popen(["true"])
    finished.wait()
    lock = {
        "write": {str(tmp_path / "models/verifier"): {"pid": child.pid, "cmd": "dvc exp run"}},
        "read": {str(tmp_path / "params.yaml"): [{"pid": finished.pid, "cmd": "dvc exp run"}]},
    }
    (tmp_path / ".dvc/tmp").mkdir(parents=True)
    (tmp_path / ".dvc/tmp/rwlock").write_text(json.dumps(lock))
    try:
        assert quality_gpu.lock_holders() == {child.pid}
        assert not quality_gpu._wait_for_lock_holders(0.1)
    finally:
        child.kill()
        child.wait()
    assert quality_gpu.lock_holders() == set()
    assert quality_gpu._wait_for_lock_holders(0.1)
