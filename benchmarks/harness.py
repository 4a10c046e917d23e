"""The small harness every benchmark script shares, so that each script keeps only what it measures.

- Shapes: verifier configs of real models (built with random weights by the scripts), and the ``--shape`` option.
- Machine facts: the CPU (model, the flags that decide matmul speed per dtype), cores and torch threads, the GPUs,
  platform and Python; every report records them, so a result says where it was measured.
- Timing: ``elapsed`` (one call, CUDA synchronized around it) and ``timed`` (warm-up calls, then timed ones:
  median and every sample), so that no script times queued GPU work by mistake.
- The report: ``header`` (the keys a result opens with) and ``write_report``, which adds the commit (and whether the
  tree was dirty), the date, the machine facts and package versions, writes the JSON atomically (a killed or failed
  run leaves no partial file) and prints it. ``provenance_missing`` names what a result lacks of these: a result that
  cannot be regenerated says so under ``provenance: incomplete`` (tests/test_results.py checks every committed one).
- ``greedy_equality``: greedy mismatches read off an evaluation, for the scripts that run the evaluate stage.

torch is imported inside the functions that need it: compare_scale and kill_trials time other processes.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click

from expman.provenance import atomic_write, package_versions


def _llama(hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int, layers: int) -> dict:
    return {
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "vocab_size": vocab,
        "hidden_act": "silu",
        "rope_theta": 500000.0,
        "num_hidden_layers": layers,
    }


SHAPES = {
    "smollm2-135m": _llama(576, 1536, 9, 3, 49152, 30) | {"rope_theta": 100000.0, "max_position_embeddings": 8192},
    "llama3-8b": _llama(4096, 14336, 32, 8, 128256, 32),
    "kimi-k2": _llama(7168, 18432, 64, 8, 163840, 61),
}


def shape_option(default: str, **options: Any) -> Callable:
    """The ``--shape`` option: one of SHAPES."""
    return click.option("--shape", type=click.Choice(sorted(SHAPES)), default=default, show_default=True, **options)


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (Linux), else what the platform module knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


DTYPE_FLAGS = {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}


def cpu_flags() -> list[str]:
    """The CPU flags that decide matmul speed per dtype (AVX2 only, AVX512, native bf16, AMX), from /proc/cpuinfo."""
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []:
        if line.startswith("flags"):
            return sorted(set(line.split(":", 1)[1].split()) & DTYPE_FLAGS)
    return []


def device_name(device: str) -> str:
    """The GPU's name on CUDA, else the CPU's."""
    import torch

    return torch.cuda.get_device_name() if device == "cuda" else cpu_name()


def machine_facts() -> dict[str, Any]:
    """Where this process runs: CPU model and flags, cores, torch's threads, GPU name and count, platform, Python."""
    import torch

    gpus = torch.cuda.device_count()
    return {
        "cpu": cpu_name(),
        "cpu_flags": cpu_flags(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if gpus else None,
        "gpu_count": gpus,
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


REPO = Path(__file__).resolve().parents[1]


def git_state(repo: Path = REPO) -> dict[str, Any]:
    """``git_commit`` (HEAD of the checkout holding this harness) and ``git_dirty`` (tracked files differ from it),
    so a result names the code that measured it. Where the tree is no git checkout (a device machine's copy), the
    commit is ``BENCH_GIT_COMMIT`` from the environment, or None, and ``git_dirty`` None: unknown, never guessed."""
    try:
        top, commit = subprocess.run(
            ["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=repo, capture_output=True, text=True, check=True
        ).stdout.split()
        if Path(top).resolve() != repo.resolve():  # a copy of the tree inside another repository
            raise ValueError(top)
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo, capture_output=True, text=True
        )
    except (OSError, ValueError, subprocess.CalledProcessError):
        return {"git_commit": os.environ.get("BENCH_GIT_COMMIT") or None, "git_dirty": None}
    return {"git_commit": commit, "git_dirty": bool(status.stdout.strip()) if status.returncode == 0 else None}


def utc_now() -> str:
    """The date and time, ISO 8601 in UTC to the second: when a report was written."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def calls_seconds(calls: Any) -> float | None:
    """The seconds of a script's device calls summed by its own clock (rows of ``calls`` with ``seconds``), beside
    any ``device_seconds`` typed on the command line; None where the report holds no such rows."""
    if not isinstance(calls, list) or not calls or not all(isinstance(c, dict) and "seconds" in c for c in calls):
        return None
    return sum(float(c["seconds"]) for c in calls)


PROVENANCE_KEYS = ("commit", "command", "date", "machine.cpu", "machine.cpu_flags", "packages")


def provenance_missing(report: dict[str, Any]) -> list[str]:
    """Which of PROVENANCE_KEYS a result lacks (commit is ``git_commit`` or ``commit``, command may be ``commands``;
    an empty or null value counts as missing): a result lacking any cannot be traced to the code and machine."""
    machine = report.get("machine") if isinstance(report.get("machine"), dict) else {}
    present = {
        "commit": bool(report.get("git_commit") or report.get("commit")),
        "command": bool(report.get("command") or report.get("commands")),
        "date": bool(report.get("date")),
        "machine.cpu": isinstance(machine.get("cpu"), str) and bool(machine["cpu"]),
        "machine.cpu_flags": isinstance(machine.get("cpu_flags"), list),
        "packages": isinstance(report.get("packages"), dict) and bool(report["packages"]),
    }
    return [key for key in PROVENANCE_KEYS if not present[key]]


def header(benchmark: str, device: str | None = None) -> dict[str, Any]:
    """The keys a report opens with: the benchmark, the command that ran it, the commit it ran at and, given the
    device measured on, that device's name and torch's CPU threads."""
    head: dict[str, Any] = {"benchmark": benchmark, "command": "python " + " ".join(sys.argv), **git_state()}
    if device is not None:
        import torch

        head |= {"device": device_name(device), "cpu_threads": torch.get_num_threads()}
    return head


@dataclass(frozen=True)
class Timing:
    """The seconds of each timed call."""

    samples: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    def summary(self) -> dict[str, float]:
        return {"median": self.median, "min": min(self.samples), "max": max(self.samples)}


def _synchronize(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def elapsed(run: Callable[[], Any], device: str = "cpu") -> tuple[float, Any]:
    """Seconds of one call of ``run`` with the work it queued on the device (CUDA synchronized before and after),
    and what it returned."""
    _synchronize(device)
    started = time.perf_counter()
    result = run()
    _synchronize(device)
    return time.perf_counter() - started, result


def timed(
    run: Callable[..., Any],
    repeats: int,
    *,
    warmup: int = 0,
    setup: Callable[[], Any] | None = None,
    device: str = "cpu",
) -> Timing:
    """``warmup`` untimed calls of ``run``, then ``repeats`` timed ones. ``setup``, when given, runs untimed before
    each call and its result is ``run``'s argument (a fresh batch, an emptied folder)."""
    samples = []
    for index in range(warmup + repeats):
        call = run if setup is None else functools.partial(run, setup())
        seconds, _ = elapsed(call, device)
        if index >= warmup:
            samples.append(seconds)
    return Timing(samples)


def greedy_equality(evaluation: dict[str, Any], arm: str) -> dict[str, dict[str, Any]]:
    """Per k of one arm of an evaluation.json: greedy mismatches, tie flips and the largest gap (units in the last
    place) among the divergences counted as ties."""
    rows = {}
    for key, values in evaluation["summary"][arm].items():
        divergences = [p[arm][key.removeprefix("k")].get("greedy_divergence") for p in evaluation["prompts"]]
        rows[key] = {
            "greedy_mismatches": values["greedy_mismatches"],
            "greedy_tie_flips": values["greedy_tie_flips"],
            "largest_tie_gap_ulps": max((d["gap_ulps"] for d in divergences if d and d["tie"]), default=None),
        }
    return rows


def in_child(script: str, *args: str) -> dict[str, Any]:
    """Run ``python script args`` in a process of its own (a fresh CUDA context, allocator and kernel-plan cache)
    and return the JSON object on the last line it prints, or its last error line under ``error``."""
    import subprocess

    done = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(lines[-1])


def arm_key(done: dict[str, Any], arm: str) -> str:
    """The report key for the next run of ``arm``: the arm itself, then ``arm#2``, ``arm#3``: an arm repeated in
    ``--arms`` (interleaved against machine drift) keeps every run instead of overwriting the first."""
    runs = sum(key.partition("#")[0] == arm for key in done)
    return f"{arm}#{runs + 1}" if runs else arm


RUNNING_STAGE = re.compile(r"Running stage '(\w+)'")


def timed_dvc(args: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, dict[str, float]]:
    """A dvc command's seconds, and each stage's as DVC runs it: from its ``Running stage`` line to the next (or the
    end), so the stage's process start-up and DVC hashing and caching its outputs count, as a user waits for them."""
    from collections import deque

    marks: list[tuple[str, float]] = []
    tail: deque[str] = deque(maxlen=100)
    started = time.monotonic()
    command = [sys.executable, "-m", "dvc", *args]
    with subprocess.Popen(
        command,
        cwd=cwd,
        env=env | {"PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as process:
        for line in process.stdout:
            tail.append(line)
            if match := RUNNING_STAGE.search(line):
                marks.append((match.group(1), time.monotonic()))
    ended = time.monotonic()
    if process.returncode:
        raise click.ClickException(f"dvc {' '.join(args)} failed in {cwd}:\n{''.join(tail)}")
    ends = [at for _, at in marks[1:]] + [ended] * bool(marks)
    return ended - started, {stage: end - start for (stage, start), end in zip(marks, ends, strict=True)}


def write_report(path: Path | None, report: dict[str, Any], *, machine: bool = True) -> None:
    """Print the result JSON and write it to ``path`` (if given) atomically, with what says where it came from: the
    command line, commit, dirty flag and date (ISO UTC), the summed seconds of its device ``calls`` if it has any
    and, with ``machine``, this machine's facts and package versions (torch, transformers, ...; beside any others the
    report names). Leave ``machine`` off only for a report made away from the machine that measured: then the
    commit and date it already holds (the measuring run's) are kept, and this run's fill in only what is absent."""
    full = dict(report)
    full.setdefault("command", "python " + " ".join(sys.argv))
    stamp = git_state() | {"date": utc_now()}
    for key, value in stamp.items():
        if machine or full.get(key) is None:
            full[key] = value
    if (seconds := calls_seconds(full.get("calls"))) is not None:
        full["device_call_seconds"] = seconds
    if machine:
        full["packages"] = full.get("packages", {}) | package_versions()
        full["machine"] = machine_facts()
    text = json.dumps(full, indent=2)
    if path is not None:
        atomic_write(path, lambda tmp: tmp.write_text(text + "\n"))
    click.echo(text)
