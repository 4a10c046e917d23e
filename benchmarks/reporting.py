"""What every benchmark script shares: verifier shapes (configs of real models, built with random weights), the
CPU's name for the machine facts, greedy equality read off an evaluation, and the result JSON written to ``--out``
and printed."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import click


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


def write_report(report: dict[str, Any], out: Path | None) -> None:
    """Write the result JSON to ``out`` (if given) and print it."""
    text = json.dumps(report, indent=2)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    click.echo(text)


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
