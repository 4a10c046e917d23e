"""expman promote: move an alias to a version only when the version passes the gates of the ``promote`` params
section, and leave the audit trail on the version.

Gates, read from the version's own evaluation at ``promote.k`` (default: its largest k):
- ``tau_gain``: tau(version) - tau(baseline), paired by prompt (see expman.registry.compare), must exceed
  ``min_tau_gain``; without a baseline measurement the gate fails: "better than the baseline" cannot be shown.
- ``speedup``: tok/s(version) / tok/s(no speculation) of the same run must exceed ``min_speedup`` on ``target``.
- ``greedy_equality``: every prompt's output equals plain greedy decoding, at every evaluated k.
- ``integration_fault``: the serving engine's verdict (``expman.integration_fault``) is ``false``; with
  ``require_engine: false`` a version no engine measured passes too, only ``true`` fails.
A gate fails when what it reads was not measured (``not measured``: no baseline, no speedup, no engine verdict) and
when the evaluation names no target.
A failing gate refuses the promotion unless ``force`` is given with a reason. Audit tags
``expman.promote.<alias>.{by,at,gates,forced,reason,require_engine}`` are written on the version before the alias
moves, so the version an alias points at always carries the record of how it got there (``forced`` is true when
failing gates were overridden). The alias moves in one MLflow update; concurrent promotions serialize and the last
one wins.
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

__all__ = ["NOT_MEASURED", "Gate", "PromotionRefused", "evaluate_gates", "promote", "render_gates", "render_json"]

NOT_MEASURED = "not measured"
NO_ENGINE = "no serving-engine measurement: run the benchmark stage, or set promote.require_engine: false"


@dataclass(frozen=True)
class Gate:
    """One promotion gate: did it pass, what was measured (``not measured`` when nothing was), what was required,
    and a note on what to do where the numbers alone do not say."""

    name: str
    passed: bool
    measured: str
    required: str
    note: str = ""


class PromotionRefused(ExpmanError):
    """Failing gates and no ``force``: the message names each failing gate; ``gates`` holds them all."""

    def __init__(self, message: str, version: VersionRecord, k: int, gates: list[Gate]) -> None:
        super().__init__(message)
        self.version, self.k, self.gates = version, k, gates


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
        gates = [Gate("tau_gain", False, NOT_MEASURED, required_gain, f"no baseline measurement: {row['note']}")]
    else:
        low, high = tau["delta_ci"]
        measured = f"{tau['delta']:+.3f} vs {report['baseline']['label']}, {row['pairing']}, CI {low:+.3f}..{high:+.3f}"
        gates = [Gate("tau_gain", tau["delta"] > section.min_tau_gain, measured, required_gain)]
    required_speedup = f"> {section.min_speedup:.3f}x on {section.target}"
    if speedup is None:
        gates.append(Gate("speedup", False, NOT_MEASURED, required_speedup))
    else:  # an evaluation that names no target was not measured on the configured one
        on_target = row["target"] == section.target
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
        fault = version.tags.get(INTEGRATION_FAULT_TAG) or NOT_MEASURED
        if section.require_engine:
            note = NO_ENGINE if fault == NOT_MEASURED else ""
            gates.append(Gate("integration_fault", fault == "false", fault, "false", note))
        else:
            gates.append(Gate("integration_fault", fault != "true", fault, "not true (promote.require_engine: false)"))
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
        listed = "; ".join(
            f"{g.name}: measured {g.measured}, required {g.required}" + (f" ({g.note})" if g.note else "")
            for g in failing
        )
        raise PromotionRefused(f"{model} v{version.version} not promoted to @{alias}: {listed}", version, k, gates)
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
            prefix + "require_engine": json.dumps(section.require_engine),
        },
    )
    set_alias(model, alias, version.version)
    return version, k, gates


def render_gates(version: VersionRecord, alias: str, k: int, gates: list[Gate], target: str) -> str:
    """The gates as an aligned table under a one-line heading."""
    rows = [["gate", "result", "measured", "required", "note"]]
    rows += [[g.name, "pass" if g.passed else "FAIL", g.measured, g.required, g.note] for g in gates]
    return "\n".join([f"{version.name} v{version.version} -> @{alias} (k={k}, target {target})", *text_table(rows)])


def render_json(version: VersionRecord, alias: str, k: int, gates: list[Gate], target: str, promoted: bool) -> str:
    """The outcome as JSON for scripts: every gate with what was measured, or ``not measured``."""
    outcome = {"model": version.name, "version": version.version, "alias": alias, "k": k, "target": target}
    forced = promoted and not all(g.passed for g in gates)
    return json.dumps(outcome | {"promoted": promoted, "forced": forced, "gates": [asdict(g) for g in gates]}, indent=2)
