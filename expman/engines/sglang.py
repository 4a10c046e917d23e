"""SGLang as a serving engine (``expman.engines.serving``), driven through its server without importing it.

``launch_command`` builds the server's command line: EAGLE-3 with a chain of k drafts (vLLM's
``num_speculative_tokens=k`` is SGLang's steps k, top-k 1, draft tokens k + 1), or no speculation. ``SglangEngine``
starts one server per arm on a free loopback port, sends a warm-up request and then every prompt (token ids) greedy in
one timed ``POST /generate``, and reads the arm's acceptance from the replies' ``meta_info``: rounds
(``spec_verify_ct``) and the histogram of accepted drafts per round, which gives the unconditional rate of every
position. ``GET /get_server_info`` (newer servers: ``/server_info``) reports τ cumulative since the server started,
its own warm-up request included; ``parse_server_info`` reads it, and the arm records it beside its own numbers.
SGLang returns no hidden states at chosen layer ids (``return_hidden_states`` gives the last layer's), so the
parity check is not measured in it. SGLang serves on GPUs here (its CPU backend needs AMX and does not list EAGLE-3).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.error import HTTPError, URLError
from urllib.request import Request, urlopen

from expman.engines.metrics import AcceptanceCounters
from expman.engines.serving import ArmResult, ArmSetup
from expman.errors import ExpmanError

__all__ = ["SglangEngine", "counters_from_meta_info", "launch_command", "parse_server_info"]

ACCEPT_TOKENS = "spec_cumulative_num_accept_tokens"
VERIFY_ROUNDS = "spec_cumulative_num_forward_ct"
HISTOGRAMS = ("spec_correct_drafts_histogram", "spec_accept_histogram")
"""Per request, rounds that accepted exactly n drafts (bonus token not counted); the first name is newer SGLang's."""
START_TIMEOUT_S = 1800.0
"""How long a server may take to load the verifier and drafter and capture its CUDA graphs."""
STOP_TIMEOUT_S = 60.0


def launch_command(
    model_path: str | Path,
    drafter_path: str | Path | None,
    k: int,
    host: str = "127.0.0.1",
    port: int = 30000,
    extra: Sequence[str] = (),
) -> list[str]:
    """``python -m sglang.launch_server`` serving ``model_path`` with an EAGLE-3 chain of ``k`` drafts (without
    ``drafter_path``: no speculation, ``k`` unused); bound to loopback unless ``host`` says otherwise. ``extra``
    flags are appended verbatim."""
    speculative: list[str] = []
    if drafter_path is not None:
        if k < 1:
            raise ExpmanError(f"sglang: k must be at least 1, got {k}")
        speculative = [
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
        ]
    return [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model_path),
        *speculative,
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


def counters_from_meta_info(meta_infos: Sequence[Mapping[str, Any]], k: int) -> AcceptanceCounters:
    """The counters of one batch from its replies' ``meta_info``: rounds (``spec_verify_ct``), k drafts per round,
    accepted drafts and the rounds accepting each position, from the per-request histogram of accepted drafts."""
    rounds, histogram = 0, [0] * (k + 1)
    for meta in meta_infos:
        verified = int(meta.get("spec_verify_ct") or 0)
        if not verified:
            continue  # finished at prefill: no verification round
        counts = next((meta[name] for name in HISTOGRAMS if meta.get(name)), None)
        if counts is None:
            raise ExpmanError(
                "sglang /generate: meta_info has spec_verify_ct but no spec_accept_histogram (per-position "
                "acceptance needs a newer SGLang)"
            )
        if len(counts) > k + 1 or sum(counts) != verified:
            raise ExpmanError(
                f"sglang /generate: spec_accept_histogram {counts} does not describe {verified} rounds of at most "
                f"{k} drafts"
            )
        rounds += verified
        for n, count in enumerate(counts):
            histogram[n] += int(count)
    if not rounds:
        raise ExpmanError("sglang /generate: no verification rounds in the replies (speculation off or no requests)")
    return AcceptanceCounters(
        drafts=rounds,
        draft_tokens=rounds * k,
        accepted_tokens=sum(n * count for n, count in enumerate(histogram)),
        accepted_per_position=tuple(sum(histogram[i + 1 :]) for i in range(k)),
    )


class SglangEngine:
    """SGLang's server as a serving engine: timed arms and their counters; no hidden states."""

    name = "sglang"
    states_unsupported = "sglang returns no hidden states at the checkpoint's layer ids (only the last layer's)"

    def version(self) -> str | None:
        from importlib import metadata

        try:
            return f"sglang {metadata.version('sglang')}"
        except metadata.PackageNotFoundError:
            return None

    def run_arm(self, setup: ArmSetup, drafter_dir: Path | None, k: int) -> ArmResult:
        """A fresh server for the arm (its counters count from its start); a warm-up request, then every prompt
        greedy in one timed request; ``server_tau`` is what ``/get_server_info`` reports after it."""
        if setup.device == "cpu":
            raise ExpmanError("benchmark.engine sglang: serves on GPUs only here; on CPU use benchmark.engine: vllm")
        command = launch_command(setup.model_dir, drafter_dir, k, port=_free_port(), extra=_server_flags(setup))
        settings: dict[str, Any] = {
            "dtype": setup.dtype,
            "seed": setup.seed,
            "max_new_tokens": setup.max_new_tokens,
            "batch": len(setup.prompts),
            "compile": setup.compile,
            "server": command[3:],
        }
        with _server(command) as url:
            _post(url, "/generate", {"input_ids": setup.prompts[0], "sampling_params": {"max_new_tokens": 4}})
            greedy = {"temperature": 0.0, "max_new_tokens": setup.max_new_tokens}
            started = time.perf_counter()
            replies = _post(url, "/generate", {"input_ids": setup.prompts, "sampling_params": greedy})
            seconds = time.perf_counter() - started
            info = _server_info(url)
        if drafter_dir is not None:
            settings["server_tau"] = parse_server_info(info)
        outputs = [list(reply["output_ids"]) for reply in replies]
        return ArmResult(outputs, seconds, settings, {"k": k, "meta_info": [r["meta_info"] for r in replies]})

    def acceptance(self, arm: ArmResult) -> AcceptanceCounters:
        return counters_from_meta_info(arm.raw["meta_info"], arm.raw["k"])

    def hidden_states(
        self,
        model_dir: Path,
        layer_ids: Sequence[int],
        prompts: Sequence[Sequence[int]],
        device: str,
        dtype: str,
        trust_remote_code: bool,
    ) -> list[Any]:
        raise ExpmanError(f"benchmark.engine sglang: {self.states_unsupported}")


def _server_flags(setup: ArmSetup) -> list[str]:
    """Precision, seed and the verifier's code; without ``compile`` no CUDA graphs."""
    flags = ["--dtype", setup.dtype, "--random-seed", str(setup.seed)]
    if setup.trust_remote_code:
        flags.append("--trust-remote-code")
    if not setup.compile:
        flags.append("--disable-cuda-graph")
    return flags


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def _server(command: list[str]) -> Iterator[str]:
    """The server of ``command`` in a session of its own, its output in a temporary log; yields its URL once
    ``/health`` answers, and stops the whole session (its scheduler processes too) after."""
    url = f"http://{command[command.index('--host') + 1]}:{command[command.index('--port') + 1]}"
    with tempfile.TemporaryFile("w+") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_ready(server, url, log)
            yield url
        finally:
            _stop(server)


def _wait_ready(server: subprocess.Popen, url: str, log: Any) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            log.seek(0)
            tail = log.read()[-2000:].strip()
            raise ExpmanError(f"sglang server exited with {server.returncode} before it was ready:\n{tail}")
        with contextlib.suppress(URLError, ConnectionError, TimeoutError), urlopen(f"{url}/health", timeout=5) as reply:
            if reply.status == 200:
                return
        time.sleep(1)
    raise ExpmanError(f"sglang server at {url}: not ready after {START_TIMEOUT_S:g} s")


def _stop(server: subprocess.Popen) -> None:
    """SIGTERM to the server's session (its scheduler and detokenizer processes too), SIGKILL if it lingers."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def _post(url: str, path: str, body: dict[str, Any]) -> Any:
    request = Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urlopen(request) as reply:
            return json.load(reply)
    except HTTPError as error:
        raise ExpmanError(f"sglang {path}: HTTP {error.code}: {error.read().decode(errors='replace')[:500]}") from None
    except URLError as error:  # the server went away mid-request
        raise ExpmanError(f"sglang {path}: {error.reason}") from None


def _server_info(url: str) -> dict[str, Any]:
    """``/get_server_info``, or ``/server_info`` where a newer server has only that."""
    for path in ("/get_server_info", "/server_info"):
        try:
            with urlopen(url + path) as reply:
                return json.load(reply)
        except HTTPError as error:
            if error.code != 404:
                raise ExpmanError(f"sglang {path}: HTTP {error.code}") from None
        except URLError as error:
            raise ExpmanError(f"sglang {path}: {error.reason}") from None
    raise ExpmanError(f"sglang server at {url}: neither /get_server_info nor /server_info")
