"""SGLang: the EAGLE-3 server command for a chain of k drafts, and τ from recorded ``/get_server_info`` JSON.

The fixtures follow SGLang's source (sgl-project/sglang): ``python/sglang/srt/entrypoints/http_server.py``
``get_server_info`` returns the server args, the scheduler info and ``internal_states`` (one per DP rank, from
``python/sglang/srt/managers/scheduler.py`` ``Scheduler.get_internal_state``: ``avg_spec_accept_length`` only when
speculation is on and a round ran; newer servers add ``spec_cumulative_num_accept_tokens`` /
``spec_cumulative_num_forward_ct``, see its ``TestSpecCumulativeServerInfo`` test); older servers put
``avg_spec_accept_length`` at the top level. Values are made up, trimmed to the fields that matter.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from expman.engines.sglang import launch_command, parse_server_info
from expman.errors import ExpmanError

FIXTURES = Path(__file__).parent / "fixtures"


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
