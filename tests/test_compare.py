"""expman compare on fixture registries: values, deltas and bootstrap CIs against a hand computation, in-run and
cross-run pairing, the three output formats, and runs from another directory (sqlite and a real mlflow server)
that never import mlflow."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from expman.cli import main
from expman.provenance import sha256_file
from tests.registry_fixtures import TARGET, add_version, arm_result, evaluation, tiny_checkpoint, use_store


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    use_store(tmp_path, monkeypatch)
    return tmp_path


def _prompt(prompt_id: str, nospec: tuple[int, float], **arms: tuple[int, int, int, float]) -> dict:
    """A k=1 prompt row; each arm is (rounds, accepted, tokens, seconds)."""
    row = {"id": prompt_id, "category": "coding", "nospec": {"tokens": nospec[0], "seconds": nospec[1]}}
    for arm, (rounds, accepted, tokens, seconds) in arms.items():
        row[arm] = {"1": arm_result(1, rounds, [accepted], tokens, seconds)}
    return row


def _shas(store: Path) -> tuple[Path, str, Path, str]:
    base, cand = tiny_checkpoint(store / "base", 0), tiny_checkpoint(store / "cand", 1)
    return base, sha256_file(base / "model.safetensors"), cand, sha256_file(cand / "model.safetensors")


def _in_run_registry(store: Path) -> None:
    """v1 @baseline (not evaluated itself), v2 @candidate evaluated with a baseline arm of v1's weights.

    By hand, pooled over prompts a and b: tau 160/90 vs 160/130; speedup (3.5/2.2) vs (3.5/2.85). Resampling two
    prompts gives {a,a}, {a,b}, {b,b}, each far above 2.5 % of 2000 draws, so every 95 % interval runs exactly
    from one prompt's own value to the other's: tau [1.5, 2.0]; its delta [1.5 - 1.2, 2.0 - 1.25]."""
    base, base_sha, cand, cand_sha = _shas(store)
    add_version("eagle3-tiny", base, alias="baseline")
    prompts = [
        _prompt("a", (100, 2.0), baseline=(80, 20, 100, 1.6), candidate=(50, 50, 100, 1.0)),
        _prompt("b", (60, 1.5), baseline=(50, 10, 60, 1.25), candidate=(40, 20, 60, 1.2)),
    ]
    result = evaluation(prompts, [1], {"baseline": base_sha, "candidate": cand_sha})
    add_version("eagle3-tiny", cand, result, "candidate")


def _report(*args: str) -> dict:
    result = CliRunner().invoke(main, ["compare", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_values_deltas_and_intervals_match_a_hand_computation(store: Path) -> None:
    _in_run_registry(store)
    report = _report()
    assert report["model"] == "eagle3-tiny" and report["baseline"] == {"version": 1, "label": "v1 (@baseline)"}
    (row,) = report["rows"]
    assert (row["version"], row["k"], row["prompts"], row["pairing"]) == (2, 1, 2, "in-run")
    metrics = row["metrics"]
    assert set(metrics) == {"tau", "acceptance_rate", "position_1", "speedup"}
    tau = metrics["tau"]
    assert tau["value"] == pytest.approx(160 / 90) and tau["baseline"] == pytest.approx(160 / 130)
    assert tau["delta"] == pytest.approx(160 / 90 - 160 / 130)
    assert tau["ci"] == pytest.approx([1.5, 2.0]) and tau["delta_ci"] == pytest.approx([0.3, 0.75])
    acceptance = metrics["acceptance_rate"]
    assert acceptance["value"] == pytest.approx(70 / 90) and acceptance["baseline"] == pytest.approx(30 / 130)
    assert acceptance["ci"] == pytest.approx([0.5, 1.0]) and acceptance["delta_ci"] == pytest.approx([0.3, 0.75])
    assert metrics["position_1"] == acceptance  # at k=1 the one position is every draft
    speedup = metrics["speedup"]
    assert speedup["value"] == pytest.approx(3.5 / 2.2) and speedup["baseline"] == pytest.approx(3.5 / 2.85)
    assert speedup["ci"] == pytest.approx([1.25, 2.0]) and speedup["delta_ci"] == pytest.approx([0.05, 0.75])


def test_cross_run_pairing_uses_the_prompts_both_evaluated(store: Path) -> None:
    base, base_sha, cand, cand_sha = _shas(store)
    own = [  # the baseline version's own evaluation: it is the candidate arm there
        _prompt("b", (60, 1.5), candidate=(50, 10, 60, 1.25)),
        _prompt("c", (60, 1.6), candidate=(40, 20, 60, 1.0)),
        _prompt("d", (60, 1.6), candidate=(10, 10, 60, 0.1)),
    ]
    add_version("eagle3-tiny", base, evaluation(own, [1], {"candidate": base_sha}), "baseline")
    prompts = [  # its baseline arm ran other weights (sha differs): not the baseline version
        _prompt("a", (100, 2.0), baseline=(99, 0, 100, 9.0), candidate=(10, 10, 100, 0.1)),
        _prompt("b", (60, 1.5), baseline=(99, 0, 60, 9.0), candidate=(40, 20, 60, 1.2)),
        _prompt("c", (60, 1.8), baseline=(99, 0, 60, 9.0), candidate=(30, 30, 60, 0.9)),
    ]
    add_version("eagle3-tiny", cand, evaluation(prompts, [1], {"baseline": "0" * 64, "candidate": cand_sha}))
    (row,) = _report("2")["rows"]
    assert (row["pairing"], row["prompts"]) == ("cross-run", 2)
    tau = row["metrics"]["tau"]
    assert tau["value"] == pytest.approx(120 / 70) and tau["baseline"] == pytest.approx(120 / 90)
    assert tau["delta_ci"] == pytest.approx([0.3, 0.5])  # prompt b: 1.5 - 1.2; prompt c: 2.0 - 1.5
    speedup = row["metrics"]["speedup"]  # each against the no-speculation arm of its own run
    assert speedup["value"] == pytest.approx(3.3 / 2.1) and speedup["baseline"] == pytest.approx(3.1 / 2.25)


def test_speedup_comes_from_the_prompts_timed_alone(store: Path) -> None:
    """evaluate.timed_prompts: a prompt decoded only in a worker sharing the device counts for tau, not speedup."""
    base, base_sha, cand, cand_sha = _shas(store)
    add_version("eagle3-tiny", base, alias="baseline")
    prompts = [
        _prompt("a", (100, 2.0), baseline=(80, 20, 100, 1.6), candidate=(50, 50, 100, 1.0)),
        _prompt("b", (60, 1.5), baseline=(50, 10, 60, 1.25), candidate=(40, 20, 60, 1.2)),
        _prompt("c", (60, 0.5), baseline=(30, 30, 60, 9.0), candidate=(30, 30, 60, 9.0)) | {"timed": False},
    ]
    for row in prompts[:2]:
        row["timed"] = True
    add_version("eagle3-tiny", cand, evaluation(prompts, [1], {"baseline": base_sha, "candidate": cand_sha}))
    (row,) = _report("2")["rows"]
    assert row["prompts"] == 3 and row["metrics"]["tau"]["value"] == pytest.approx(220 / 120)
    speedup = row["metrics"]["speedup"]
    assert speedup["value"] == pytest.approx(3.5 / 2.2) and speedup["baseline"] == pytest.approx(3.5 / 2.85)


def test_without_a_baseline_there_are_no_deltas(store: Path) -> None:
    _, _, cand, cand_sha = _shas(store)
    prompts = [_prompt("a", (100, 2.0), candidate=(50, 50, 100, 1.0))]
    add_version("eagle3-tiny", cand, evaluation(prompts, [1], {"candidate": cand_sha}), "candidate")
    (row,) = _report()["rows"]
    assert row["pairing"] is None and row["note"] == "no baseline version"
    assert set(row["metrics"]["tau"]) == {"value", "ci"}
    result = CliRunner().invoke(main, ["compare", "--k", "3"])
    assert result.exit_code == 2 and result.stderr == "error: eagle3-tiny v1: k=3 was not evaluated (ks 1)\n"


def test_text_and_markdown_tables(store: Path) -> None:
    _in_run_registry(store)
    text = CliRunner().invoke(main, ["compare"]).stdout.splitlines()
    assert text[0].startswith("model eagle3-tiny, baseline v1 (@baseline); 95% CI: bootstrap over prompts, 2000")
    assert f"v2 (@candidate) k=1: 2 prompts on {TARGET}" in text[1] and "baseline paired in-run" in text[1]
    header = next(line for line in text if line.startswith("version"))
    tau = next(line for line in text if " tau " in line)
    assert re.split(r"\s{2,}", tau) == [
        "v2 (@candidate)",
        "1",
        "tau",
        "1.778",
        "[1.500, 2.000]",
        "1.231",
        "+0.547",
        "[+0.300, +0.750]",
    ]
    for column, cell in (("metric", "tau"), ("delta 95% CI", "[+0.300"), ("baseline", "1.231")):
        assert header.index(column) == tau.index(cell), column  # aligned columns

    markdown = CliRunner().invoke(main, ["compare", "--md"]).stdout.splitlines()
    assert "| version | k | metric | value | 95% CI | baseline | delta | delta 95% CI |" in markdown
    assert "| v2 (@candidate) | 1 | speedup | 1.591 | [1.250, 2.000] | 1.228 | +0.363 | [+0.050, +0.750] |" in markdown


def _compare_elsewhere(tmp_path: Path, uri: str) -> dict:
    """`expman compare --json` from an unrelated directory with only MLFLOW_TRACKING_URI set; which heavy modules
    it imported."""
    code = (
        "import json, sys; from click.testing import CliRunner; from expman.cli import main; "
        "r = CliRunner().invoke(main, ['compare', '--json']); "
        "heavy = sorted(m for m in ('mlflow', 'torch', 'transformers') if m in sys.modules); "
        "print(json.dumps({'exit': r.exit_code, 'out': r.output, 'heavy': heavy}))"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DVC_"))}
    env["MLFLOW_TRACKING_URI"] = uri
    done = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_from_another_directory_without_importing_mlflow(store: Path) -> None:
    _in_run_registry(store)
    result = _compare_elsewhere(store, os.environ["MLFLOW_TRACKING_URI"])
    assert result["exit"] == 0 and result["heavy"] == []
    assert json.loads(result["out"]) == _report()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.integration
def test_a_tracking_server_gives_the_same_report(store: Path) -> None:
    _in_run_registry(store)
    port = _free_port()
    command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", os.environ["MLFLOW_TRACKING_URI"]]
    command += ["--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.5)
        result = _compare_elsewhere(store, f"http://127.0.0.1:{port}")
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)
    assert result["exit"] == 0, result["out"]
    assert result["heavy"] == []
    assert json.loads(result["out"]) == _report()
