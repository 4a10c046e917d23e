"""SGLang: the EAGLE-3 server command for a chain of k drafts, τ from recorded ``/get_server_info`` JSON, and the
adapter behind ``expman.engines.serving`` driving a stand-in server that answers with recorded replies.

The fixtures follow SGLang's source (sgl-project/sglang): ``python/sglang/srt/entrypoints/http_server.py``
``get_server_info`` returns the server args, the scheduler info and ``internal_states`` (one per DP rank, from
``python/sglang/srt/managers/scheduler.py`` ``Scheduler.get_internal_state``: ``avg_spec_accept_length`` only when
speculation is on and a round ran; newer servers add ``spec_cumulative_num_accept_tokens`` /
``spec_cumulative_num_forward_ct``, see its ``TestSpecCumulativeServerInfo`` test); older servers put
``avg_spec_accept_length`` at the top level. ``/generate`` replies carry ``output_ids`` and ``meta_info`` with
``spec_verify_ct`` and the histogram of accepted drafts per round (``python/sglang/srt/managers/tokenizer_manager.py``:
``spec_correct_drafts_histogram``, older ``spec_accept_histogram``). Values are made up, trimmed to the fields that
matter. No real SGLang runs here: it needs a GPU (``tests/fixtures/sglang_server`` stands in for its server).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.error import URLError
from urllib.request import urlopen

import pytest

from expman.engines.factory import serving_engine
from expman.engines.serving import ArmSetup
from expman.engines.sglang import counters_from_meta_info, launch_command, parse_server_info
from expman.errors import ExpmanError
from expman.params import BenchmarkParams

FIXTURES = Path(__file__).parent / "fixtures"
RECORDED = json.loads((FIXTURES / "sglang_generate.json").read_text())
PROMPTS = [[1, 2, 3, 4, 5, 6], [1, 2, 7, 8, 9, 10], [1, 2, 11, 12, 13, 14]]


def server_info(name: str) -> dict:
    return json.loads((FIXTURES / f"sglang_{name}.json").read_text())


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_launch_command_for_k3():
    command = launch_command("/models/verifier", "/models/drafter", 3, extra=["--dtype", "bfloat16"])
    assert command[1:3] == ["-m", "sglang.launch_server"]
    assert flag(command, "--model-path") == "/models/verifier"
    assert flag(command, "--speculative-algorithm") == "EAGLE3"
    assert flag(command, "--speculative-draft-model-path") == "/models/drafter"
    assert flag(command, "--speculative-num-steps") == "3"
    assert flag(command, "--speculative-eagle-topk") == "1"
    assert flag(command, "--speculative-num-draft-tokens") == "4"
    assert flag(command, "--host") == "127.0.0.1"
    assert flag(command, "--port") == "30000"
    assert command[-2:] == ["--dtype", "bfloat16"]


def test_launch_command_binds_elsewhere_only_when_told():
    command = launch_command("v", "d", 1, host="0.0.0.0", port=31000)
    assert (flag(command, "--host"), flag(command, "--port")) == ("0.0.0.0", "31000")
    assert flag(command, "--speculative-num-draft-tokens") == "2"
    with pytest.raises(ExpmanError, match="k must be at least 1, got 0"):
        launch_command("v", "d", 0)


def test_counters_pool_ranks_by_their_rounds():
    # (3300 + 900) / (1200 + 400), not the unweighted mean of 2.75 and 2.25.
    assert parse_server_info(server_info("server_info")) == pytest.approx(2.625)


def test_without_counters_the_ranks_accept_lengths_are_averaged():
    assert parse_server_info(server_info("server_info_no_counters")) == pytest.approx(2.5)


def test_older_servers_top_level_field():
    assert parse_server_info(server_info("server_info_top_level")) == pytest.approx(3.1)


def test_no_speculation_is_a_clear_error():
    with pytest.raises(ExpmanError, match="no avg_spec_accept_length .speculative_algorithm=None"):
        parse_server_info(server_info("server_info_no_spec"))


def test_launch_command_without_a_drafter_serves_without_speculation():
    command = launch_command("v", None, 0, port=31000)
    assert not [part for part in command if part.startswith("--speculative")]
    assert command[3:] == ["--model-path", "v", "--host", "127.0.0.1", "--port", "31000"]


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m sglang.launch_server`` runs tests/fixtures/sglang_server's stand-in."""
    folder = str(FIXTURES / "sglang_server")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [folder, os.environ.get("PYTHONPATH")])))


def _setup(**changes: Any) -> ArmSetup:
    fields = {"model_dir": Path("/models/verifier"), "prompts": PROMPTS, "max_new_tokens": 16, "device": "cuda"}
    fields |= {"dtype": "bfloat16", "seed": 0, "trust_remote_code": False, "compile": True}
    return ArmSetup(**(fields | changes))


def _is_down(server: list[str]) -> bool:
    try:
        urlopen(f"http://127.0.0.1:{server[server.index('--port') + 1]}/health", timeout=2)
    except URLError:
        return True
    return False


def test_the_adapter_runs_arms_and_reads_their_counters_through_the_interface(stand_in: None) -> None:
    engine = serving_engine("sglang")
    nospec = engine.run_arm(_setup(compile=False), None, 0)
    assert nospec.outputs == [reply["output_ids"] for reply in RECORDED["replies"]["none"]]
    assert not [flag for flag in nospec.settings["server"] if flag.startswith("--speculative")]
    assert "--disable-cuda-graph" in nospec.settings["server"] and "server_tau" not in nospec.settings
    arm = engine.run_arm(_setup(trust_remote_code=True), Path("/models/drafter"), 3)
    server = arm.settings["server"]
    assert flag(server, "--speculative-draft-model-path") == "/models/drafter"
    assert (flag(server, "--speculative-num-steps"), flag(server, "--speculative-num-draft-tokens")) == ("3", "4")
    assert (flag(server, "--dtype"), flag(server, "--random-seed")) == ("bfloat16", "0")
    assert "--trust-remote-code" in server and "--disable-cuda-graph" not in server
    assert arm.outputs == nospec.outputs and arm.seconds > 0
    assert _is_down(server) and _is_down(nospec.settings["server"])  # one server per arm, stopped after it
    counters = engine.acceptance(arm)
    # histograms [1, 1, 1, 2] + [0, 2, 1, 1] + [3, 2, 1, 0] over 5 + 4 + 6 rounds of 3 drafts
    assert (counters.drafts, counters.draft_tokens, counters.accepted_tokens) == (15, 45, 20)
    assert counters.accepted_per_position == (11, 6, 3)
    assert counters.tau == pytest.approx(1 + 20 / 15)
    assert arm.settings["server_tau"] == pytest.approx(45 / 20)  # since the server started: warm-ups included


def test_the_benchmark_measures_sglang_and_records_parity_as_not_measured(stand_in: None) -> None:
    """The benchmark stage's engine loop on SGLang: acceptance against the reference, and the parity check says it
    was not measured (SGLang returns no hidden states at layer ids) instead of passing."""
    from expman.evaluation.benchmark import _run_engine, _Work
    from expman.registry.register import engine_tags

    reference = {"tau": 2.4, "per_position": [0.75, 0.4, 0.2], "speedup": 1.3}
    evaluation = {"max_new_tokens": 16, "summary": {"candidate": {"k3": reference}}}
    drafter = Path("/models/drafter")
    work = _Work({"trust_remote_code": False}, evaluation, [3], PROMPTS, {"candidate": drafter}, {"candidate": None})
    result: dict[str, Any] = {"engine": "sglang", "arms": {}, "precision": {"device": "cuda", "dtype": "bfloat16"}}
    logged: dict[str, float] = {}
    run = SimpleNamespace(log_metrics=logged.update)
    where = SimpleNamespace(verifier=Path("/models/verifier"))
    _run_engine(run, BenchmarkParams(engine="sglang"), where, work, result)
    candidate = result["arms"]["candidate"]
    why = "not measured: sglang returns no hidden states at the checkpoint's layer ids (only the last layer's)"
    assert candidate["parity"] == {"checked": False, "why": why}
    measured = candidate["k"]["3"]
    assert measured["engine"]["tau"] == pytest.approx(1 + 20 / 15)
    assert measured["engine"]["per_position"] == pytest.approx([11 / 15, 6 / 15, 3 / 15])
    assert measured["engine"]["outputs_equal_to_nospec"] == 3 and measured["reasons"] == []
    assert logged["candidate/k3/engine_tau"] == pytest.approx(1 + 20 / 15)
    assert result["engine_version"] is None  # SGLang is not installed here: the tags name the engine
    assert engine_tags(result)["expman.engine"] == "sglang"


def test_a_server_that_dies_before_it_is_ready_is_a_clear_error(stand_in: None, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_SGLANG_FAIL", "1")
    with pytest.raises(ExpmanError, match=r"sglang server exited with 1 before it was ready:\n.*No CUDA GPUs"):
        serving_engine("sglang").run_arm(_setup(), Path("/models/drafter"), 3)


def test_a_refused_request_is_a_clear_error(stand_in: None) -> None:
    with pytest.raises(ExpmanError, match=r"^sglang /generate: HTTP 400: .*recorded: 3 greedy prompts"):
        serving_engine("sglang").run_arm(_setup(prompts=PROMPTS[:2]), None, 0)


def test_sglang_refuses_cpu_and_hidden_states() -> None:
    engine = serving_engine("sglang")
    with pytest.raises(ExpmanError, match="sglang: serves on GPUs only here; on CPU use benchmark.engine: vllm"):
        engine.run_arm(_setup(device="cpu"), None, 0)
    with pytest.raises(ExpmanError, match="sglang returns no hidden states"):
        engine.hidden_states(Path("v"), [1, 2], PROMPTS, "cuda", "bfloat16", False)
    assert serving_engine("vllm").states_unsupported is None
    with pytest.raises(ExpmanError, match="no serving engine 'tgi'"):
        serving_engine("tgi")


def test_counters_need_a_histogram_that_matches_the_rounds() -> None:
    meta = RECORDED["replies"]["eagle3"][2]["meta_info"]
    assert counters_from_meta_info([meta], 3).accepted_per_position == (3, 1, 0)
    with pytest.raises(ExpmanError, match="no spec_accept_histogram"):
        counters_from_meta_info([{**meta, "spec_accept_histogram": None}], 3)
    with pytest.raises(ExpmanError, match=r"does not describe 6 rounds of at most 2 drafts"):
        counters_from_meta_info([meta], 2)
    with pytest.raises(ExpmanError, match="no verification rounds"):
        counters_from_meta_info(RECORDED["replies"]["none"], 3)
