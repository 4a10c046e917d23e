"""expman doctor on tiny fixtures: nvidia-smi rows (a recorded sample, a fake nvidia-smi on PATH), the extract
disk estimate, the capture contract across manifest, checkpoints and registry, versions, and the exit code."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from importlib import metadata, util
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml
from click.testing import CliRunner

from expman import doctor, paths
from expman.cli import main
from expman.data.extract import capture_contract
from expman.data.features import FeatureStore
from expman.data.shards import readable_size
from expman.doctor import (
    GpuProcess,
    check_contract,
    check_disk,
    check_features,
    check_gpu,
    check_versions,
    extract_estimate,
    parse_compute_apps,
)
from expman.params import ExtractParams, load_params
from expman.registry.tracking import set_alias
from expman.registry.versions import contract_tags
from tests.registry_fixtures import add_version, tiny_checkpoint, use_store

# nvidia-smi 580.159.04 on an H200, while one process (pid 449) held a 3 GiB cuMemAlloc plus its CUDA context
RECORDED = "449, python3, 3590\n"
QUERY = "--query-compute-apps=pid,process_name,used_memory --format=csv,noheader,nounits"
MODEL = "eagle3-tiny-verifier"  # the name register gives the tiny project's verifier (prepare.source: tiny-verifier)
VERIFIER = {
    "architecture": "LlamaForCausalLM",
    "model_type": "llama",
    "num_hidden_layers": 8,
    "hidden_size": 16,
    "vocab_size": 50,
    "tie_word_embeddings": False,
    "tokenizer_sha256": "1" * 64,
    "chat_template_sha256": "2" * 64,
    "weights_sha256": "3" * 64,
}


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data), encoding="utf-8")


def fake_nvidia_smi(folder: Path, monkeypatch: pytest.MonkeyPatch, rows: str, code: int = 0) -> None:
    """An nvidia-smi first on PATH: it prints ``rows`` and exits ``code`` for the doctor's query, fails otherwise."""
    folder.mkdir(exist_ok=True)
    (folder / "rows.csv").write_text(rows)
    script = folder / "nvidia-smi"
    script.write_text(
        f'#!/bin/sh\n[ "$*" = "{QUERY}" ] || {{ echo "unexpected arguments: $*" >&2; exit 2; }}\n'
        f'cat "{folder / "rows.csv"}"\nexit {code}\n'
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")


@pytest.fixture
def spawn() -> Iterator[Callable[..., subprocess.Popen]]:
    """Start processes in their own group; teardown kills each group it started."""
    started: list[subprocess.Popen] = []

    def start(argv: list[str], **kwargs: Any) -> subprocess.Popen:
        started.append(subprocess.Popen(argv, start_new_session=True, **kwargs))
        return started[-1]

    yield start
    for process in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _report(args: list[str]) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(main, ["doctor", "--json", *args])
    return result.exit_code, json.loads(result.stdout)


def test_parse_compute_apps() -> None:
    assert parse_compute_apps(RECORDED) == ([GpuProcess(449, "python3", 3590)], [])
    assert parse_compute_apps("") == ([], [])
    text = "\n".join(
        [
            "3121, [Not Found], 81000",  # a pid from another container's namespace
            "12, /opt/app, v2/bin/python, [N/A]",  # a comma in the name; memory not reported (MIG)
            "No running processes found",
            "pid, process_name, used_gpu_memory [MiB]",
        ]
    )
    assert parse_compute_apps(text) == (
        [GpuProcess(3121, "[Not Found]", 81000), GpuProcess(12, "/opt/app, v2/bin/python", None)],
        ["pid, process_name, used_gpu_memory [MiB]"],
    )


def test_leftover_gpu_process_gets_its_kill_command(
    project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spawn: Callable[..., subprocess.Popen]
) -> None:
    leftover = spawn(["sleep", "120"])
    other = tmp_path / "running"
    (other / "stages").mkdir(parents=True)
    (other / "stages/train.py").write_text(  # a stage whose engine runs in a child process, as vLLM's does
        "import subprocess\nengine = subprocess.Popen(['sleep', '120'])\nprint(engine.pid, flush=True)\nengine.wait()\n"
    )
    stage = spawn([sys.executable, "stages/train.py"], cwd=other, stdout=subprocess.PIPE, text=True)
    engine = int(stage.stdout.readline())
    gone = spawn(["true"])
    gone.wait()
    rows = f"{leftover.pid}, python3, 81000\n{engine}, VLLM::EngineCore, 40000\n{gone.pid}, python3, [N/A]\n"
    fake_nvidia_smi(tmp_path / "bin", monkeypatch, rows)

    code, report = _report([])
    assert code == 1 and not report["ok"]
    errors = [f for f in report["findings"] if f["level"] == "error"]
    assert len(errors) == 1, report
    assert errors[0]["fix"] == f"kill {leftover.pid}"
    assert "81,000 MiB" in errors[0]["message"] and "sleep 120" in errors[0]["message"]
    gpu = {int(f["message"].split()[1]): f for f in report["findings"] if f["check"] == "gpu"}
    assert gpu[engine]["level"] == "info" and "running stage train" in gpu[engine]["message"]
    assert not gpu[engine]["fix"]
    assert gpu[gone.pid]["level"] == "warning" and "not in this machine's process table" in gpu[gone.pid]["message"]

    text = CliRunner().invoke(main, ["doctor"])
    assert text.exit_code == 1 and f"fix: kill {leftover.pid}" in text.stdout


def test_a_failing_nvidia_smi_and_no_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    failure = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n"
    fake_nvidia_smi(tmp_path / "bin", monkeypatch, failure, code=9)
    [finding] = check_gpu()
    assert finding.level == "warning" and finding.message == f"nvidia-smi failed: {failure.strip()}"
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert [(f.level, f.message) for f in check_gpu()] == [("ok", "no GPU: nvidia-smi not found")]


def test_disk_estimate_against_free_space(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    params = load_params("params.yaml")
    before = extract_estimate(params)  # before generate: 10 train prompts × max_seq_len, hidden from the source
    assert (before.tokens, before.bytes_per_token) == (10 * 2048, 4 * 32 * 2 + 9)
    _write_json(paths.VERIFIER / "manifest.json", {"stage": "prepare", "verifier": {"hidden_size": 64}})
    split = {"records": 10, "failed": 0, "prompt_tokens": 700, "response_tokens": 100, "shards": []}
    _write_json(paths.GENERATED / "manifest.json", {"stage": "generate", "splits": {"train": split}})
    estimate = extract_estimate(params)
    assert (estimate.tokens, estimate.bytes_per_token, estimate.total) == (800, 521, 416_800)

    def level(free: int) -> doctor.Finding:
        monkeypatch.setattr(doctor.shutil, "disk_usage", lambda _: SimpleNamespace(free=free))
        [finding] = check_disk(params)
        return finding

    full = level(400_000)
    assert full.level == "error" and "416.8 kB" in full.message and "400.0 kB free" in full.message
    assert f"the feature store {FeatureStore.default().root} " in full.message
    assert full.fix == (
        "expman features gc --yes, or export EXPMAN_FEATURE_STORE=<a folder on a disk with 416.8 kB free>"
    )
    assert level(500_000).level == "warning"
    assert level(10_000_000).level == "ok"
    elsewhere = (project / "elsewhere").resolve()
    monkeypatch.setenv("EXPMAN_FEATURE_STORE", str(elsewhere))
    assert f"the feature store {elsewhere} " in level(400_000).message  # the store the variable names


def test_features_the_store_lacks_are_an_error(project: Path) -> None:
    assert check_features() == []  # no extract manifest yet: nothing to look for
    manifest = {"stage": "extract", "features": {"key": "k1"}, "shards": [{}, {}]}
    _write_json(paths.EXTRACT / "manifest.json", manifest)
    [finding] = check_features()
    assert finding.level == "error" and "features k1 (2 shards)" in finding.message, finding
    assert finding.fix.startswith("export EXPMAN_FEATURE_STORE=<the store that has them>")
    store = FeatureStore.default()
    _write_json(store.folder("k1") / "set.json", {"key": "k1", "shards": []})
    [finding] = check_features()
    assert finding.level == "ok" and str(store.root) in finding.message, finding


@pytest.mark.integration
def test_estimate_matches_what_extract_stores(project: Path) -> None:
    from tests.test_pipeline import run_until

    run_until("extract")
    manifest = json.loads((paths.EXTRACT / "manifest.json").read_text())
    estimate = extract_estimate(load_params("params.yaml"))
    assert estimate.tokens == manifest["totals"]["tokens"]
    assert abs(estimate.total / manifest["storage"]["bytes"] - 1) < 0.05  # headers and offsets are the rest


@pytest.mark.integration
def test_disk_check_credits_what_the_store_holds(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Published features need no room; the shards a killed extract left in its partial folder count as written."""
    from tests.test_pipeline import run_until

    run_until("extract")
    params = load_params("params.yaml")
    key = json.loads((paths.EXTRACT / "manifest.json").read_text())["features"]["key"]
    free = extract_estimate(params).total // 2
    monkeypatch.setattr(doctor.shutil, "disk_usage", lambda _: SimpleNamespace(free=free))
    [finding] = check_disk(params)
    assert finding.level == "ok" and f"features {key} of these params are in the feature store" in finding.message

    store = FeatureStore.default()
    partial = store.partial_folder(key)
    store.folder(key).rename(partial)  # as a kill before publishing leaves it: every shard written
    (partial / "set.json").unlink()
    written = sum(p.stat().st_size for p in partial.glob("*.safetensors"))
    [finding] = check_disk(params)
    assert f"{readable_size(written)} of it written already by an interrupted extract" in finding.message
    assert finding.level == "ok"  # all of it but the estimate's margin is on disk: half the estimate free is enough
    for shard in partial.glob("*.safetensors"):
        shard.unlink()
    assert check_disk(params)[0].level == "error"  # all of it to write again, into half its size


def consistent_project(root: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Prepare and extract manifests, the baseline and the trained drafter (tiny checkpoints: aux ids [2, 4, 5],
    hidden 16, vocab 50) and registry versions v1 @baseline, v2 @candidate, all of one capture contract."""
    contract = capture_contract(VERIFIER, ExtractParams())
    _write_json(paths.VERIFIER / "manifest.json", {"stage": "prepare", "source": "tiny-verifier", "verifier": VERIFIER})
    _write_json(paths.EXTRACT / "manifest.json", {"stage": "extract", "contract": contract})
    for seed, (stage, folder) in enumerate((("baseline", paths.BASELINE), ("train", paths.DRAFTER))):
        tiny_checkpoint(folder, seed)
        _write_json(folder / "manifest.json", {"stage": stage, "contract": contract})
    use_store(root, monkeypatch)
    add_version(MODEL, paths.BASELINE, alias="baseline", tags=contract_tags(contract))
    add_version(MODEL, paths.DRAFTER, alias="candidate", tags=contract_tags(contract))
    return contract


def test_consistent_project_then_a_checkpoint_off_by_one(
    project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    consistent_project(project, monkeypatch)
    fake_nvidia_smi(tmp_path / "bin", monkeypatch, "")  # an idle GPU
    result = CliRunner().invoke(main, ["doctor"])
    assert result.exit_code == 0, result.output
    assert result.stdout.rstrip().endswith("no problems found")
    checked = (
        f"models/verifier/manifest.json, models/baseline, models/drafter, {MODEL} v1 @baseline, {MODEL} v2 @candidate"
    )
    assert f"agrees with {checked}" in result.stdout

    config = json.loads((paths.DRAFTER / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [3, 5, 6]  # the integration fault: ids shifted by one
    (paths.DRAFTER / "config.json").write_text(json.dumps(config))
    code, report = _report([])
    assert code == 1
    [error] = [f for f in report["findings"] if f["level"] == "error"]
    assert "data/extract/manifest.json" in error["message"] and "models/drafter/config.json" in error["message"]
    assert "[3, 5, 6] != aux_layers [2, 4, 5]" in error["message"]
    assert error["fix"] == "dvc repro train"


def test_registry_and_verifier_that_disagree_with_the_manifest(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    contract = consistent_project(project, monkeypatch)
    shifted = {**contract_tags(contract), "expman.contract.aux_layers": "[1, 3, 4]"}
    stale = add_version(MODEL, paths.DRAFTER, alias="candidate", tags=shifted)
    set_alias(MODEL, "champion", stale)
    prepared = {"stage": "prepare", "source": "tiny-verifier", "verifier": {**VERIFIER, "weights_sha256": "4" * 64}}
    _write_json(paths.VERIFIER / "manifest.json", prepared)

    findings = {(f.level, f.fix): f.message for f in check_contract(MODEL)}
    assert set(findings) == {
        ("error", "dvc repro extract"),
        ("error", "dvc repro --force register"),
        ("warning", f"expman promote {MODEL} @candidate --alias champion"),
    }
    assert "weights_sha256" in findings["error", "dvc repro extract"]
    assert f"{MODEL} v3 (@candidate)" in findings["error", "dvc repro --force register"]
    assert "aux_layers" in findings["error", "dvc repro --force register"]


def test_versions_without_importing_vllm(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    imported = "vllm" in sys.modules
    [info] = check_versions(load_params("params.yaml"))  # tiny params: HF backend, no engine benchmark, device auto
    assert info.level == "info" and f"torch {torch.__version__}" in info.message
    assert f"mlflow {metadata.version('mlflow')}" in info.message
    engines = metadata.packages_distributions().get("vllm", []) if util.find_spec("vllm") else []
    assert (f"engine: {engines[0]} {metadata.version(engines[0])}" if engines else "vllm not installed") in info.message
    assert ("vllm" in sys.modules) == imported

    params = yaml.safe_load(Path("params.yaml").read_text())
    params["benchmark"]["engine"] = "vllm"
    params["train"]["device"] = "cuda"
    Path("params.yaml").write_text(yaml.safe_dump(params))
    find_spec = util.find_spec
    monkeypatch.setattr(util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    errors = {f.fix: f.message for f in check_versions(load_params("params.yaml")) if f.level == "error"}
    assert errors == {
        "pip install -e '.[engine]'": "benchmark.engine: vllm, which is not installed",
        "dvc exp run -S train.device=auto": "train.device: cuda, but torch sees no CUDA device",
    }


def test_invalid_params_is_a_finding(project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_nvidia_smi(tmp_path / "bin", monkeypatch, "")
    params = yaml.safe_load(Path("params.yaml").read_text())
    params["train"]["epochs"] = 0
    Path("params.yaml").write_text(yaml.safe_dump(params))
    code, report = _report(["--params", "params.yaml"])
    assert code == 1
    [error] = [f for f in report["findings"] if f["level"] == "error"]
    assert error["check"] == "params" and "train.epochs" in error["message"]
    assert error["fix"] == "expman params check --params params.yaml"
    assert {f["check"] for f in report["findings"]} == {"gpu", "params", "contract", "versions"}
