"""expman promote: move an alias to a version only when the version passes the gates of the ``promote`` params
section, and leave the audit trail on the version.

Gates, read from the version's own evaluation at ``promote.k`` (default: its largest k):
- ``tau_gain``: tau(version) - tau(baseline), paired by prompt (see expman.registry.compare), must exceed
  ``min_tau_gain``; without a baseline measurement the gate fails: "better than the baseline" cannot be shown.
- ``speedup``: tok/s(version) / tok/s(no speculation) of the same run must exceed ``min_speedup`` on ``target``.
- ``greedy_equality``: every prompt's output equals plain greedy decoding, at every evaluated k.
- ``integration_fault``: the version is not tagged ``expman.integration_fault=true``.
A failing gate refuses the promotion unless ``force`` is given with a reason. Audit tags
``expman.promote.<alias>.{by,at,gates,forced,reason}`` are written on the version before the alias moves, so the
version an alias points at always carries the record of how it got there (``forced`` is true when failing gates
were overridden). The alias moves in one MLflow update; concurrent promotions serialize and the last one wins.
"""

from __future__ import annotations

import getpass
import json
import socket
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from expman.errors import ExpmanError
from expman.params import EvaluateParams, PromoteParams
from expman.registry.compare import compare
from expman.registry.reader import RegistryReader, VersionRecord
from expman.registry.tables import text_table
from expman.registry.tracking import set_alias, set_version_tags
from expman.registry.versions import INTEGRATION_FAULT_TAG, check_alias, resolve_model, resolve_version

__all__ = ["Gate", "evaluate_gates", "promote", "render_gates"]


@dataclass(frozen=True)
class Gate:
    """One promotion gate: did it pass, what was measured, what was required."""

    name: str
    passed: bool
    measured: str
    required: str


def resolved_target(section: PromoteParams, evaluate: EvaluateParams) -> PromoteParams:
    """``section`` with ``target: auto`` replaced by the target ``evaluate`` measures on, on this machine."""
    if section.target != "auto":
        return section
    from expman.devices import resolve_device, speedup_target

    return section.model_copy(update={"target": speedup_target(resolve_device(evaluate.device), evaluate.dtype)})


def evaluate_gates(report: dict[str, Any], version: VersionRecord, section: PromoteParams) -> tuple[int, list[Gate]]:
    """(k, gates) for a compare ``report`` holding every evaluated k of ``version``."""
    by_k = {row["k"]: row for row in report["rows"]}
    k = section.k if section.k is not None else max(by_k)
    if k not in by_k:
        raise ExpmanError(f"promote.k: {k} was not evaluated for {version.name} v{version.version} (ks {sorted(by_k)})")
    row = by_k[k]
    tau, speedup = row["metrics"]["tau"], row["metrics"]["speedup"]["value"]
    required_gain = f"> {section.min_tau_gain:+.3f}"
    if tau.get("delta") is None:
        gates = [Gate("tau_gain", False, f"no baseline measurement ({row['note']})", required_gain)]
    else:
        low, high = tau["delta_ci"]
        measured = f"{tau['delta']:+.3f} vs {report['baseline']['label']}, {row['pairing']}, CI {low:+.3f}..{high:+.3f}"
        gates = [Gate("tau_gain", tau["delta"] > section.min_tau_gain, measured, required_gain)]
    required_speedup = f"> {section.min_speedup:.3f}x on {section.target}"
    if speedup is None:
        gates.append(Gate("speedup", False, "undefined", required_speedup))
    else:  # an evaluation that names no target is taken to have run on the configured one
        on_target = row["target"] in (None, section.target)
        measured = f"{speedup:.3f}x on {row['target'] or 'an unnamed target'}"
        gates.append(Gate("speedup", on_target and speedup > section.min_speedup, measured, required_speedup))
    if section.require_greedy_equality:
        problems = [
            f"k={r['k']}: {r['greedy_mismatches']} differ, {r['greedy_unchecked']} unchecked"
            for r in report["rows"]
            if r["greedy_mismatches"] or r["greedy_unchecked"]
        ]
        measured = "; ".join(problems) or f"all equal at k={','.join(str(r['k']) for r in report['rows'])}"
        gates.append(Gate("greedy_equality", not problems, measured, "every output equals greedy"))
    if section.block_integration_fault:
        fault = version.tags.get(INTEGRATION_FAULT_TAG)
        gates.append(Gate("integration_fault", fault != "true", fault or "not measured", "not true"))
    return k, gates


def _who() -> str:
    try:
        user = getpass.getuser()
    except (OSError, KeyError):  # no login name in some containers
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def promote(
    reader: RegistryReader,
    model: str | None,
    ref: str,
    alias: str,
    section: PromoteParams,
    force: bool = False,
    reason: str | None = None,
) -> tuple[VersionRecord, int, list[Gate]]:
    """Check the gates for version ``ref`` and, if they pass (or ``force`` with a ``reason``), write the audit tags
    and move ``alias`` to it. Returns (version, k, gates); a refusal is an error naming each failing gate."""
    check_alias(alias)
    if force and not (reason or "").strip():
        raise ExpmanError("--force needs --reason TEXT: the reason is recorded on the version")
    model = resolve_model(reader, model)
    version = resolve_version(reader, model, ref)
    k, gates = evaluate_gates(compare(reader, [str(version.version)], model), version, section)
    failing = [g for g in gates if not g.passed]
    if failing and not force:
        listed = "; ".join(f"{g.name}: measured {g.measured}, required {g.required}" for g in failing)
        raise ExpmanError(f"{model} v{version.version} not promoted to @{alias}: {listed}")
    prefix = f"expman.promote.{alias}."
    record = {"k": k, "target": section.target, "gates": [asdict(g) for g in gates]}
    set_version_tags(
        model,
        version.version,
        {
            prefix + "by": _who(),
            prefix + "at": datetime.now(UTC).isoformat(timespec="seconds"),
            prefix + "gates": json.dumps(record),
            prefix + "forced": json.dumps(bool(failing)),
            prefix + "reason": reason or "",
        },
    )
    set_alias(model, alias, version.version)
    return version, k, gates


def render_gates(version: VersionRecord, alias: str, k: int, gates: list[Gate], target: str) -> str:
    """The gates as an aligned table under a one-line heading."""
    rows = [["gate", "result", "measured", "required"]]
    rows += [[g.name, "pass" if g.passed else "FAIL", g.measured, g.required] for g in gates]
    return "\n".join([f"{version.name} v{version.version} -> @{alias} (k={k}, target {target})", *text_table(rows)])
