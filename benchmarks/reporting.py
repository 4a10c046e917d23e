"""What every benchmark script shares: the CPU's name for the machine facts, and the result JSON written to
``--out`` and printed."""

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


def write_report(report: dict[str, Any], out: Path | None) -> None:
    """Write the result JSON to ``out`` (if given) and print it."""
    text = json.dumps(report, indent=2)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    click.echo(text)
