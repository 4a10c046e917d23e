"""expman promote: gates that pass and fail (each failing one named with measured vs required), what was not
measured failing its gate (no engine verdict, no target named), --force and promote.require_engine: false recorded,
--json listing every gate, the params file's promote section, and two concurrent promotions leaving one consistent
alias."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from expman.cli import main
from expman.provenance import sha256_file
from expman.registry.reader import open_registry
from expman.registry.tracking import set_version_tags
from tests.conftest import tiny_params, write_prompts
from tests.registry_fixtures import TARGET, add_version, synthetic_evaluation, tiny_checkpoint, use_store

MODEL = "eagle3-tiny"
AUDIT = "expman.promote.champion."
ENGINE_OK = {"expman.integration_fault": "false"}
"""The tags of a version the serving engine measured and found no integration fault in."""
NO_ENGINE = "no serving-engine measurement: run the benchmark stage, or set promote.require_engine: false"


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """v1 @baseline (acceptance 0.3), v2 @candidate (0.6: faster than no speculation and than the baseline), v3
    (0.1: slower than both); v2 and v3 were evaluated with v1 as their baseline arm; the engine measured all three."""
    use_store(tmp_path, monkeypatch)
    base = tiny_checkpoint(tmp_path / "base", 0)
    base_sha = sha256_file(base / "model.safetensors")
    add_version(MODEL, base, synthetic_evaluation({"candidate": (base_sha, 0.3)}, seed=1), "baseline", ENGINE_OK)
    for seed, quality, alias in ((2, 0.6, "candidate"), (3, 0.1, None)):
        drafter = tiny_checkpoint(tmp_path / f"v{seed}", seed)
        arms = {"baseline": (base_sha, 0.3), "candidate": (sha256_file(drafter / "model.safetensors"), quality)}
        add_version(MODEL, drafter, synthetic_evaluation(arms, seed=seed), alias, ENGINE_OK)
    return tmp_path


def _promote(*args: str):
    return CliRunner().invoke(main, ["promote", MODEL, *args])


def _refused(result, *expected: str) -> None:
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1, result.stderr
    for text in expected:
        assert text in result.stderr, result.stderr
    assert open_registry().alias(MODEL, "champion") is None


def test_passing_gates_move_the_alias_with_an_audit_trail(store: Path) -> None:
    result = _promote("@candidate", "--alias", "champion")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0] == f"{MODEL} v2 -> @champion (k=3, target {TARGET})"
    assert "tau_gain           pass" in result.stdout and result.stdout.endswith("is now @champion\n")
    reader = open_registry()
    assert reader.alias(MODEL, "champion") == 2
    tags = reader.version(MODEL, 2).tags
    assert tags[AUDIT + "forced"] == "false" and tags[AUDIT + "reason"] == ""
    assert tags[AUDIT + "require_engine"] == "true"
    assert "@" in tags[AUDIT + "by"] and tags[AUDIT + "at"].endswith("+00:00")
    record = json.loads(tags[AUDIT + "gates"])
    assert record["k"] == 3 and record["target"] == TARGET
    assert [(g["name"], g["passed"]) for g in record["gates"]] == [
        ("tau_gain", True),
        ("speedup", True),
        ("greedy_equality", True),
        ("integration_fault", True),
    ]


def test_failing_gates_are_refused_and_named(store: Path) -> None:
    _refused(
        _promote("3"),
        f"{MODEL} v3 not promoted to @champion: tau_gain: measured -",
        "required > +0.000",
        "speedup: measured 0.",
        f"required > 1.000x on {TARGET}",
    )
    assert "greedy_equality" not in _promote("3").stderr  # passing gates are not listed
    assert not any(key.startswith("expman.promote.") for key in open_registry().version(MODEL, 3).tags)


def test_force_needs_a_reason_and_is_recorded(store: Path) -> None:
    _refused(_promote("3", "--force"), "--force needs --reason")
    result = _promote("3", "--force", "--reason", "engine bug makes the baseline look good")
    assert result.exit_code == 0, result.output
    assert "(forced: gates failed)" in result.stdout and "speedup            FAIL" in result.stdout
    tags = open_registry().version(MODEL, 3).tags
    assert tags[AUDIT + "forced"] == "true"
    assert tags[AUDIT + "reason"] == "engine bug makes the baseline look good"
    assert open_registry().alias(MODEL, "champion") == 3


def test_an_integration_fault_blocks_promotion(store: Path) -> None:
    set_version_tags(MODEL, 2, {"expman.integration_fault": "true"})
    _refused(_promote("2"), "integration_fault: measured true, required false")


def test_outputs_that_differ_from_greedy_block_promotion(store: Path) -> None:
    drafter = tiny_checkpoint(store / "v4", 4)
    result = synthetic_evaluation({"candidate": (sha256_file(drafter / "model.safetensors"), 0.6)}, seed=4)
    result["prompts"][5]["candidate"]["2"]["matches_greedy"] = False
    add_version(MODEL, drafter, result)
    _refused(_promote("4"), "greedy_equality: measured k=2: 1 differ, 0 unchecked")


def _version(store: Path, seed: int, tags: dict[str, str] | None = None, **evaluation: Any) -> str:
    """A version as good as v2 (acceptance 0.6), tagged with ``tags``; ``evaluation`` goes to its evaluation."""
    drafter = tiny_checkpoint(store / f"v{seed}", seed)
    arms = {"candidate": (sha256_file(drafter / "model.safetensors"), 0.6)}
    return str(add_version(MODEL, drafter, synthetic_evaluation(arms, seed=seed, **evaluation), tags=tags))


@pytest.mark.parametrize(
    "tags",
    [{"expman.engine": "none", "expman.integration_fault": "not measured"}, {}],
    ids=["benchmark-engine-none", "imported"],
)
def test_a_version_no_engine_measured_is_refused(store: Path, tags: dict[str, str]) -> None:
    refused = _promote(_version(store, 4, tags))
    _refused(refused, "v4 not promoted to @champion: integration_fault: measured not measured", f"false ({NO_ENGINE})")
    assert "tau_gain" not in refused.stderr and "speedup" not in refused.stderr  # the engine is all it lacks


def test_an_evaluation_that_names_no_target_fails_the_target_gate(store: Path) -> None:
    refused = _promote(_version(store, 4, ENGINE_OK, target=None))
    _refused(refused, "speedup: measured 1.", f"x on an unnamed target, required > 1.000x on {TARGET}")


def test_json_lists_every_gate_with_what_was_measured(store: Path) -> None:
    result = _promote("2", "--json")
    assert result.exit_code == 0, result.output
    outcome = json.loads(result.stdout)
    assert (outcome["version"], outcome["alias"], outcome["k"], outcome["target"]) == (2, "champion", 3, TARGET)
    assert outcome["promoted"] is True and outcome["forced"] is False
    assert [(g["name"], g["passed"]) for g in outcome["gates"]] == [
        ("tau_gain", True),
        ("speedup", True),
        ("greedy_equality", True),
        ("integration_fault", True),
    ]
    assert outcome["gates"][1]["measured"].endswith(f"x on {TARGET}") and outcome["gates"][3]["measured"] == "false"

    drafter = tiny_checkpoint(store / "v4", 4)
    ids = [f"other-{i:04d}" for i in range(16)]  # prompts the baseline never ran
    evaluation = synthetic_evaluation({"candidate": (sha256_file(drafter / "model.safetensors"), 0.6)}, seed=4, ids=ids)
    for prompt in evaluation["prompts"]:
        prompt["timed"] = False  # no prompt decoded alone: no speedup
    add_version(MODEL, drafter, evaluation)  # and no engine verdict
    refused = _promote("4", "--json")
    assert refused.exit_code == 2 and refused.stderr.startswith(f"error: {MODEL} v4 not promoted"), refused.output
    outcome = json.loads(refused.stdout)
    assert outcome["promoted"] is False and outcome["forced"] is False
    assert {g["name"]: (g["passed"], g["measured"]) for g in outcome["gates"]} == {
        "tau_gain": (False, "not measured"),
        "speedup": (False, "not measured"),
        "greedy_equality": (True, "all equal at k=1,2,3"),
        "integration_fault": (False, "not measured"),
    }
    assert outcome["gates"][0]["note"] == "no baseline measurement: baseline v1 has no results at k=3 on these prompts"
    assert outcome["gates"][3]["note"] == NO_ENGINE


def _project(store: Path) -> dict:
    """The files a params.yaml names (a verifier folder, prompts) and the tiny params."""
    (store / "tiny-verifier").mkdir()
    (store / "tiny-verifier/config.json").write_text("{}")
    (store / "prompts").mkdir()
    write_prompts(store / "prompts", "train", 2)
    write_prompts(store / "prompts", "heldout", 2)
    return tiny_params("tiny-verifier")


def test_the_params_file_sets_the_gates(store: Path) -> None:
    params = {**_project(store), "promote": {"k": 1, "target": "vllm-cpu-batch24"}}
    (store / "params.yaml").write_text(yaml.safe_dump(params))
    _refused(_promote("2"), f"x on {TARGET}, required > 1.000x on vllm-cpu-batch24")  # measured elsewhere
    params["promote"] = {"k": 1, "min_speedup": 3.0}
    (store / "params.yaml").write_text(yaml.safe_dump(params))
    _refused(_promote("2"), f"required > 3.000x on {TARGET}")
    (store / "other.yaml").write_text(yaml.safe_dump({**params, "promote": {"k": 7}}))
    _refused(_promote("2", "--params", "other.yaml"), "promote.k: 7 was not evaluated for eagle3-tiny v2")


def test_require_engine_false_promotes_what_no_engine_measured_and_is_recorded(store: Path) -> None:
    (store / "params.yaml").write_text(yaml.safe_dump({**_project(store), "promote": {"require_engine": False}}))
    set_version_tags(MODEL, 2, {"expman.integration_fault": "true"})
    _refused(_promote("2"), "integration_fault: measured true, required not true (promote.require_engine: false)")
    result = _promote(_version(store, 4))  # no engine verdict
    assert result.exit_code == 0, result.output
    tags = open_registry().version(MODEL, 4).tags
    assert tags[AUDIT + "require_engine"] == "false" and tags[AUDIT + "forced"] == "false"
    assert json.loads(tags[AUDIT + "gates"])["gates"][-1] == {
        "name": "integration_fault",
        "passed": True,
        "measured": "not measured",
        "required": "not true (promote.require_engine: false)",
        "note": "",
    }


@pytest.mark.parametrize("flags", [{"avx2"}, {"avx2", "avx512_bf16"}], ids=["avx2-only", "avx512-bf16"])
def test_target_auto_is_the_target_this_cpu_measures_on(
    store: Path, monkeypatch: pytest.MonkeyPatch, flags: set[str]
) -> None:
    """promote.target: auto names what evaluate measures on here: float32 on an AVX2-only CPU, bfloat16 with native
    bf16. A version measured in the other dtype is refused (a bf16 speedup says nothing about fp32 serving)."""
    import expman.devices

    monkeypatch.setattr(expman.devices, "cpu_flags", lambda: frozenset(flags))
    here = "torch-cpu-bfloat16-batch1" if "avx512_bf16" in flags else "torch-cpu-float32-batch1"
    other = "torch-cpu-float32-batch1" if "avx512_bf16" in flags else "torch-cpu-bfloat16-batch1"
    params = _project(store)
    params["evaluate"]["device"] = "cpu"
    (store / "params.yaml").write_text(yaml.safe_dump({**params, "promote": {"k": 3}}))
    for seed, target in ((5, here), (6, other)):
        drafter = tiny_checkpoint(store / f"v{seed}", seed)
        arms = {"candidate": (sha256_file(drafter / "model.safetensors"), 0.6)}
        add_version(MODEL, drafter, synthetic_evaluation(arms, seed=seed, target=target), tags=ENGINE_OK)
    _refused(_promote("5"), "speedup: measured 1.", f"x on {other}, required > 1.000x on {here}")
    promoted = _promote("4")  # measured here
    assert promoted.exit_code == 0 and f"v4 -> @champion (k=3, target {here})" in promoted.stdout


def test_concurrent_promotions_leave_one_consistent_alias(store: Path) -> None:
    drafter = tiny_checkpoint(store / "v4", 4)
    arms = {"candidate": (sha256_file(drafter / "model.safetensors"), 0.7)}
    add_version(MODEL, drafter, synthetic_evaluation(arms), tags=ENGINE_OK)
    expman = Path(sys.executable).parent / "expman"
    racers = [
        subprocess.Popen([expman, "promote", MODEL, version], cwd=store, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for version in ("2", "4")
    ]
    for racer in racers:
        _, stderr = racer.communicate(timeout=300)
        assert racer.returncode == 0, stderr.decode()
    reader = open_registry()
    winner = reader.alias(MODEL, "champion")
    assert winner in (2, 4)
    tags = reader.version(MODEL, winner).tags
    assert json.loads(tags[AUDIT + "gates"])["k"] == 3 and tags[AUDIT + "forced"] == "false"
    assert {AUDIT + key for key in ("by", "at", "reason")} <= tags.keys()
