"""SGLang as an evaluation engine, without importing it: the server command line and the acceptance it reports.

SGLang (GPU only) is driven through its server: ``launch_command`` builds the EAGLE-3 command for a chain of k
drafts (vLLM's ``num_speculative_tokens=k`` is SGLang's steps k, top-k 1, draft tokens k + 1), and
``parse_server_info`` reads τ from the JSON of ``GET /get_server_info`` (newer servers: ``/server_info``).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from expman.errors import ExpmanError

__all__ = ["launch_command", "parse_server_info"]

ACCEPT_TOKENS = "spec_cumulative_num_accept_tokens"
VERIFY_ROUNDS = "spec_cumulative_num_forward_ct"


def launch_command(
    model_path: str | Path,
    drafter_path: str | Path,
    k: int,
    host: str = "127.0.0.1",
    port: int = 30000,
    extra: Sequence[str] = (),
) -> list[str]:
    """``python -m sglang.launch_server`` serving ``model_path`` with an EAGLE-3 chain of ``k`` drafts; bound to
    loopback unless ``host`` says otherwise. ``extra`` flags are appended verbatim."""
    if k < 1:
        raise ExpmanError(f"sglang: k must be at least 1, got {k}")
    return [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model_path),
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        str(drafter_path),
        "--speculative-num-steps",
        str(k),
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        str(k + 1),
        "--host",
        host,
        "--port",
        str(port),
        *extra,
    ]


def parse_server_info(server_info: Mapping[str, Any]) -> float:
    """τ (average accept length, bonus token included) from ``/get_server_info``.

    Pooled over ``internal_states`` (one per data-parallel rank): from the raw counters
    ``spec_cumulative_num_accept_tokens`` / ``spec_cumulative_num_forward_ct`` when every rank reports them (so busy
    ranks weigh more), else the mean of the ranks' ``avg_spec_accept_length``; older servers put that field at the
    top level. The value is cumulative since server start: restart the server per arm.
    """
    states = [state for state in server_info.get("internal_states") or [] if isinstance(state, Mapping)]
    if states and all(ACCEPT_TOKENS in state and VERIFY_ROUNDS in state for state in states):
        rounds = sum(state[VERIFY_ROUNDS] for state in states)
        if rounds > 0:
            return sum(state[ACCEPT_TOKENS] for state in states) / rounds
    lengths = [float(s["avg_spec_accept_length"]) for s in states if s.get("avg_spec_accept_length") is not None]
    if lengths:
        return sum(lengths) / len(lengths)
    if server_info.get("avg_spec_accept_length") is not None:
        return float(server_info["avg_spec_accept_length"])
    algorithm = server_info.get("speculative_algorithm")
    raise ExpmanError(
        f"server_info: no avg_spec_accept_length (speculative_algorithm={algorithm}; speculation off or nothing "
        "decoded yet)"
    )
