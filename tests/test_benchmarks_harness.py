"""benchmarks/harness.py's report writer: every result JSON records where it was measured (machine facts and
package versions), and a report that fails (to serialize, or before its rename) leaves no partial or temporary
file and the earlier report intact. benchmarks/quality_gpu.py run waits for an earlier run that still holds DVC's
lock, and puts back the outputs a mirrored working tree lost between calls."""

from __future__ import annotations

import importlib
import json
import os
import shutil
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


def test_in_child_returns_the_last_json_line_or_the_error(tmp_path: Path, monkeypatch) -> None:
    """An arm run in its own process comes back as the JSON object it printed last, or as its last error line."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    harness = importlib.import_module("harness")
    script = tmp_path / "arm.py"
    script.write_text(
        "import json, sys\n"
        "if sys.argv[1] == 'fail':\n"
        "    raise SystemExit('arm failed: no CUDA device')\n"
        "print('warming up')\n"
        "print(json.dumps({'arm': sys.argv[1], 'seconds': 1.5}))\n"
    )
    assert harness.in_child(str(script), "cudnn") == {"arm": "cudnn", "seconds": 1.5}
    assert harness.in_child(str(script), "fail") == {"error": "arm failed: no CUDA device"}


def test_a_repeated_arm_keeps_every_run(monkeypatch) -> None:
    """Arms repeated in --arms (interleaved against drift) each get a key of their own; a GPU report once kept only
    the last of two runs of each arm under a command line that named both."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    harness = importlib.import_module("harness")
    done: dict[str, dict] = {}
    for arm in ["padded-sdpa", "padded", "padded-sdpa", "padded", "padded-sdpa:96"]:
        done[harness.arm_key(done, arm)] = {}
    assert list(done) == ["padded-sdpa", "padded", "padded-sdpa#2", "padded#2", "padded-sdpa:96"]


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


def test_quality_gpu_run_puts_back_what_a_mirrored_tree_lost_and_nothing_else(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    quality_gpu = importlib.import_module("quality_gpu")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics/baseline.json").write_text('{"sim_tau_k3": 1.9}')
    (tmp_path / "plots/train").mkdir(parents=True)
    (tmp_path / "plots/train/loss.csv").write_text("step,loss\n1,2.0\n")
    (tmp_path / "dvc.lock").write_text("schema: '2.0'\n")
    quality_gpu.keep()
    (tmp_path / "metrics/baseline.json").write_text('{"sim_tau_k3": 2.0}')
    quality_gpu.keep()  # a later call replaces the kept copies
    assert (tmp_path / ".quality_gpu_kept/metrics/baseline.json").read_text() == '{"sim_tau_k3": 2.0}'

    for lost in ("metrics", "plots"):  # the mirror deletes untracked, unignored outputs
        shutil.rmtree(tmp_path / lost)
    (tmp_path / "dvc.lock").write_text("schema: '2.0'\nstages: {}\n")  # this one the graph rewrote: keep it
    quality_gpu.restore_kept()
    assert (tmp_path / "metrics/baseline.json").read_text() == '{"sim_tau_k3": 2.0}'
    assert (tmp_path / "plots/train/loss.csv").read_text() == "step,loss\n1,2.0\n"
    assert (tmp_path / "dvc.lock").read_text() == "schema: '2.0'\nstages: {}\n"


def test_quality_gpu_report_reads_train_metrics_a_mirrored_tree_lost(tmp_path: Path, monkeypatch) -> None:
    """The device mirrors the working tree at each call and so deletes metrics/ (untracked, unignored) before the
    call that reports: the report puts the kept copies back first. One GPU report came back with no train τ."""
    from click.testing import CliRunner

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    quality_gpu = importlib.import_module("quality_gpu")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics/train.json").write_text('{"loss": 4.5, "sim_tau_k3": 2.8, "val_samples": 2850}')
    for name, facts in (("generated", {"splits": {}}), ("extract", {"totals": {}, "storage": {"bytes": 0}})):
        (tmp_path / f"data/{name}").mkdir(parents=True)
        (tmp_path / f"data/{name}/manifest.json").write_text(json.dumps(facts))
    quality_gpu.keep()
    shutil.rmtree(tmp_path / "metrics")  # the next call's mirror
    out = tmp_path / "report.json"
    args = ["report", "--device", "GPU", "--device-cpu", "CPU", "--out", str(out)]
    result = CliRunner().invoke(quality_gpu.main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["train_validation"] == {"train": {"sim_tau_k3": 2.8, "val_samples": 2850}}


def test_quality_gpu_brings_the_evaluation_back_and_adds_only_the_engine_tau(tmp_path: Path, monkeypatch) -> None:
    """The engine benchmark runs away from the GPU machine: the evaluation and the held-out split it was made on
    travel in one file (paths outside data/ refused), and ``engine`` adds the engine's τ to the GPU report without
    touching what the GPU machine measured."""
    from click.testing import CliRunner

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    quality_gpu = importlib.import_module("quality_gpu")
    device, here = tmp_path / "device", tmp_path / "here"
    files = {
        "data/evaluate/manifest.json": json.dumps({"params": {"split": "heldout"}}),
        "data/evaluate/evaluation.json": '{"prompts": [{"id": "h1"}]}',
        "data/generated/manifest.json": '{"splits": {"heldout": {}, "train": {}}}',
        "data/generated/heldout/shard-00000.jsonl": '{"id": "h1", "ok": true}\n',
        "data/generated/train/shard-00000.jsonl": '{"id": "t1", "ok": true}\n',
    }
    for name, text in files.items():
        (device / name).parent.mkdir(parents=True, exist_ok=True)
        (device / name).write_text(text)
    runner = CliRunner()
    monkeypatch.chdir(device)
    assert runner.invoke(quality_gpu.main, ["pack-evaluation", "--out", str(tmp_path / "out")]).exit_code == 0
    here.mkdir()
    monkeypatch.chdir(here)
    assert runner.invoke(quality_gpu.main, ["unpack-evaluation", "--pieces", str(tmp_path / "out")]).exit_code == 0
    written = {str(p.relative_to(here)): p.read_text() for p in here.rglob("*") if p.is_file()}
    assert written == {name: text for name, text in files.items() if "/train/" not in name}

    packed = tmp_path / "out" / quality_gpu.EVALUATION_PACK
    packed.write_text(json.dumps({"../outside.json": "{}"}))
    result = runner.invoke(quality_gpu.main, ["unpack-evaluation", "--pieces", str(tmp_path / "out")])
    assert result.exit_code != 0 and "../outside.json is not a path under data/" in result.output
    assert not (tmp_path / "outside.json").exists()

    report = here / "report.json"
    gpu = {"stages": {"train": [{"seconds": 88.3}]}, "candidate_tau_k3": 2.27, "vllm_cpu_tau_k3": None}
    report.write_text(json.dumps(gpu))
    arm = {"k": {"3": {"engine": {"tau": 2.26}, "reference": {"tau": 2.27}}}, "integration_fault": False}
    (here / "benchmark.json").write_text(json.dumps({"engine": "vllm", "arms": {"candidate": arm}}))
    args = ["engine", "--benchmark", str(here / "benchmark.json"), "--out", str(report)]
    assert runner.invoke(quality_gpu.main, args).exit_code == 0
    merged = json.loads(report.read_text())
    assert merged["vllm_cpu_tau_k3"] == 2.26 and merged["engine"]["integration_fault"] == {"candidate": False}
    assert {key: merged[key] for key in gpu if key != "vllm_cpu_tau_k3"} == {
        key: value for key, value in gpu.items() if key != "vllm_cpu_tau_k3"
    }
    assert "machine" not in merged  # this machine did not measure the report's GPU numbers
