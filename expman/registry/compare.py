"""expman compare: speculative-decoding metrics of registered drafter versions, with deltas against the baseline
and bootstrap confidence intervals, recomputed from the per-prompt results of each version's evaluation run
(``evaluation.json``; its ``summary`` is not used).

Definitions (DESIGN.md), pooled over prompts: tau = (sum accepted + sum rounds) / sum rounds, the mean over
rounds of accepted + 1; acceptance rate = sum accepted / sum drafted; the rate at chain position i = sum
accepted_per_position[i] / sum rounds; speedup = tok/s(arm) / tok/s(no speculation) of the same evaluation run,
tok/s = sum tokens / sum seconds over the prompts the run timed (all, unless ``evaluate.timed_prompts`` timed a
few alone). Every 95 % CI is a percentile bootstrap over prompts: 2,000 resamples with
replacement, seed 0, so the same store always prints the same intervals.

Pairing with the baseline version, always by prompt id: when the version's own evaluation run also ran the
baseline (its baseline arm's sha256 equals the baseline version's ``expman.drafter.sha256``), both arms come from
that run ("in-run"): one no-speculation arm and the same machine noise for both. Otherwise the version's
candidate arm is paired with the baseline version's own candidate arm over the prompts both evaluated
("cross-run"): each speedup is still against its own run's no-speculation arm, but the runs may have seen
different machine load.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from expman.errors import ExpmanError
from expman.registry.reader import RegistryReader, VersionRecord
from expman.registry.tables import markdown_table, text_table
from expman.registry.versions import DRAFTER_SHA_TAG, INTEGRATION_FAULT_TAG, resolve_model, resolve_version

__all__ = [
    "ArmResults",
    "compare",
    "compare_arms",
    "render_json",
    "render_markdown",
    "render_text",
    "summary_metrics",
]

RESAMPLES = 2000
SEED = 0
EVALUATION_ARTIFACT = "evaluation.json"
EVALUATE_RUN_TAG = "expman.evaluate.run_id"
COUNTS = ("rounds", "accepted", "drafted", "tokens", "seconds")
COLUMNS = ("version", "k", "metric", "value", "95% CI", "baseline", "delta", "delta 95% CI")


@dataclass(frozen=True)
class ArmResults:
    """One arm of one evaluation at one k, prompt by prompt: its counters [n], accepts per chain position [n, k],
    the same run's no-speculation tokens and seconds [n], and whether each output equalled plain greedy (1, 0, or
    NaN where the run did not check: sampling at temperature > 0)."""

    ids: tuple[str, ...]
    counts: dict[str, np.ndarray]
    greedy: np.ndarray

    @classmethod
    def read(cls, evaluation: Mapping[str, Any], arm: str, k: int, where: str) -> ArmResults | None:
        """The arm's results at ``k``; None when the evaluation did not run that arm or that k."""
        if arm not in evaluation.get("arms", {}) or k not in evaluation.get("ks", []):
            return None
        prompts = evaluation.get("prompts") or []
        if not prompts:
            raise ExpmanError(f"{where}: evaluation.json has no prompts")
        try:
            results = [prompt[arm][str(k)] for prompt in prompts]
            counts = {c: np.array([float(r[c]) for r in results]) for c in COUNTS}
            counts["per_position"] = np.array([[float(x) for x in r["accepted_per_position"]] for r in results])
            counts["nospec_tokens"] = np.array([float(p["nospec"]["tokens"]) for p in prompts])
            counts["nospec_seconds"] = np.array([float(p["nospec"]["seconds"]) for p in prompts])
            counts["timed"] = np.array([float(p.get("timed", True)) for p in prompts])  # absent: written all timed
            ids = tuple(str(p["id"]) for p in prompts)
            greedy = np.array([np.nan if r["matches_greedy"] is None else float(r["matches_greedy"]) for r in results])
        except (KeyError, TypeError, ValueError) as err:
            raise ExpmanError(f"{where}: evaluation.json: the {arm} arm at k={k} lacks {err}") from None
        if counts["per_position"].shape != (len(prompts), k):
            raise ExpmanError(f"{where}: evaluation.json: accepted_per_position of the {arm} arm must have {k} entries")
        return cls(ids, counts, greedy)

    def select(self, ids: Sequence[str]) -> ArmResults:
        """The results of ``ids``, in that order."""
        position = {prompt: i for i, prompt in enumerate(self.ids)}
        rows = np.array([position[prompt] for prompt in ids], dtype=int)
        return ArmResults(tuple(ids), {c: v[rows] for c, v in self.counts.items()}, self.greedy[rows])


def _metrics(arm: ArmResults, resamples: np.ndarray | None = None) -> dict[str, Any]:
    """Every metric over all prompts (floats), or per bootstrap resample (``resamples`` [B, n] -> arrays [B])."""

    def total(values: np.ndarray) -> Any:
        return values.sum(axis=0) if resamples is None else values[resamples].sum(axis=1)

    c = arm.counts
    rounds, accepted = total(c["rounds"]), total(c["accepted"])
    with np.errstate(divide="ignore", invalid="ignore"):
        metrics = {"tau": (accepted + rounds) / rounds, "acceptance_rate": accepted / total(c["drafted"])}
        per_position = total(c["per_position"])
        for i in range(per_position.shape[-1]):
            metrics[f"position_{i + 1}"] = per_position[..., i] / rounds
        timed = c["timed"]  # speedup from the prompts decoded alone only (evaluate.timed_prompts)
        speculative = total(c["tokens"] * timed) / total(c["seconds"] * timed)
        metrics["speedup"] = speculative / (total(c["nospec_tokens"] * timed) / total(c["nospec_seconds"] * timed))
    return metrics


def _number(value: Any) -> float | None:
    if value is None:
        return None
    value = float(value)
    return None if np.isnan(value) or np.isinf(value) else value


def _interval(samples: np.ndarray) -> list[float | None]:
    if np.isnan(samples).all():
        return [None, None]
    return [_number(x) for x in np.nanpercentile(samples, [2.5, 97.5])]


def compare_arms(arm: ArmResults, baseline: ArmResults | None = None) -> dict[str, dict[str, Any]]:
    """Per metric: value and 95 % CI; with a baseline (same prompts, same order) also its value, the delta and the
    delta's CI, from the same resamples of prompts (a paired bootstrap)."""
    count = len(arm.ids)
    resamples = np.random.default_rng(SEED).integers(0, count, size=(RESAMPLES, count))
    point, boot = _metrics(arm), _metrics(arm, resamples)
    if baseline is not None:
        base_point, base_boot = _metrics(baseline), _metrics(baseline, resamples)
    table = {}
    for name, value in point.items():
        entry = {"value": _number(value), "ci": _interval(boot[name])}
        if baseline is not None:
            entry["baseline"] = _number(base_point[name])
            entry["delta"] = _number(value - base_point[name])
            entry["delta_ci"] = _interval(boot[name] - base_boot[name])
        table[name] = entry
    return table


def summary_metrics(evaluation: Mapping[str, Any], where: str) -> dict[str, float]:
    """The candidate arm's tau, speedup and acceptance rate per k (``tau_k3``, ...) over all prompts."""
    summary = {}
    for k in evaluation["ks"]:
        arm = ArmResults.read(evaluation, "candidate", k, where)
        if arm is None:
            raise ExpmanError(f"{where}: evaluation.json has no candidate arm at k={k}")
        metrics = _metrics(arm)
        for name in ("tau", "speedup", "acceptance_rate"):
            summary[f"{name}_k{k}"] = float(metrics[name])
    return summary


def _label(version: VersionRecord) -> str:
    aliases = " ".join(f"@{a}" for a in version.aliases)
    return f"v{version.version} ({aliases})" if aliases else f"v{version.version}"


def _evaluation(reader: RegistryReader, version: VersionRecord, cache: dict[str, Any]) -> tuple[str, Any]:
    """(evaluate run id, evaluation.json) of a version, each run read once."""
    where = f"{version.name} v{version.version}"
    run_id = version.tags.get(EVALUATE_RUN_TAG)
    if not run_id:
        raise ExpmanError(f"{where}: not evaluated (no tag {EVALUATE_RUN_TAG})")
    if run_id not in cache:
        run = reader.run(run_id)
        if run is None:
            raise ExpmanError(f"{where}: evaluate run {run_id} is not in the tracking store")
        cache[run_id] = reader.artifact_json(run, EVALUATION_ARTIFACT)
    return run_id, cache[run_id]


def _baseline_source(
    reader: RegistryReader, version: VersionRecord, baseline: VersionRecord | None, cache: dict[str, Any]
) -> tuple[str, Any, str] | None:
    """(pairing, evaluation, arm) that holds the baseline's results for ``version``; None if nothing does."""
    if baseline is None:
        return None
    run_id, evaluation = _evaluation(reader, version, cache)
    sha = baseline.tags.get(DRAFTER_SHA_TAG)
    if sha and evaluation.get("arms", {}).get("baseline", {}).get("sha256") == sha:
        return "in-run", evaluation, "baseline"
    if EVALUATE_RUN_TAG not in baseline.tags:
        return None
    base_run_id, base_evaluation = _evaluation(reader, baseline, cache)
    return ("in-run" if base_run_id == run_id else "cross-run"), base_evaluation, "candidate"


def _rows(
    reader: RegistryReader, version: VersionRecord, baseline: VersionRecord | None, k: int | None, cache: dict
) -> list[dict[str, Any]]:
    """One report row per k: the version's candidate arm, paired with the baseline's results where there are any."""
    where = f"{version.name} v{version.version}"
    run_id, evaluation = _evaluation(reader, version, cache)
    if k is not None and k not in evaluation["ks"]:
        raise ExpmanError(f"{where}: k={k} was not evaluated (ks {', '.join(map(str, evaluation['ks']))})")
    source = _baseline_source(reader, version, baseline, cache)
    rows = []
    for chain in [k] if k is not None else evaluation["ks"]:
        arm = ArmResults.read(evaluation, "candidate", chain, where)
        if arm is None:
            raise ExpmanError(f"{where}: evaluation.json has no candidate arm at k={chain}")
        mismatches, unchecked = int((arm.greedy == 0).sum()), int(np.isnan(arm.greedy).sum())  # all prompts
        pairing, note, base_arm = None, None, None
        if baseline is None:
            note = "no baseline version"
        elif source is None:
            note = f"baseline v{baseline.version} has no results paired with this evaluation"
        else:
            source_pairing, base_evaluation, base_arm_name = source
            base_arm = ArmResults.read(base_evaluation, base_arm_name, chain, f"{baseline.name} v{baseline.version}")
            shared = set() if base_arm is None else set(base_arm.ids)
            common = [i for i in arm.ids if i in shared]
            if not common:
                note, base_arm = f"baseline v{baseline.version} has no results at k={chain} on these prompts", None
            else:
                pairing, arm, base_arm = source_pairing, arm.select(common), base_arm.select(common)
        rows.append(
            {
                "version": version.version,
                "aliases": list(version.aliases),
                "label": _label(version),
                "evaluate_run_id": run_id,
                "k": chain,
                "prompts": len(arm.ids),
                "pairing": pairing,
                "note": note,
                "target": evaluation.get("target"),
                "greedy_mismatches": mismatches,
                "greedy_unchecked": unchecked,
                "metrics": compare_arms(arm, base_arm),
                "engine": _engine(version, chain),
            }
        )
    return rows


def _engine(version: VersionRecord, k: int) -> dict[str, Any]:
    """The benchmark stage's verdict and engine numbers at k, as the register stage tagged them."""
    tags = version.tags

    def number(name: str) -> float | None:
        return _number(tags.get(f"expman.engine.k{k}.{name}"))

    return {
        "name": tags.get("expman.engine"),
        "tau": number("tau"),
        "speedup": number("speedup"),
        "tau_ratio": number("tau_ratio"),
        "integration_fault": tags.get(INTEGRATION_FAULT_TAG, "not measured"),
        "reasons": tags.get(INTEGRATION_FAULT_TAG + ".reasons"),
    }


def _engine_note(engine: Mapping[str, Any]) -> str:
    if engine["integration_fault"] == "true":
        return f"INTEGRATION FAULT in {engine['name']}: {engine['reasons']}"
    if engine["tau"] is None:
        return f"engine: {engine['name'] or 'not benchmarked'}"
    speedup = "not measured" if engine["speedup"] is None else f"{engine['speedup']:.3f}x"
    return (
        f"engine {engine['name']}: tau {engine['tau']:.3f} ({engine['tau_ratio']:.2f}x reference), "
        f"speedup {speedup}, integration fault {engine['integration_fault']}"
    )


def compare(
    reader: RegistryReader,
    refs: Sequence[str],
    model: str | None = None,
    baseline_ref: str | None = None,
    k: int | None = None,
) -> dict[str, Any]:
    """The comparison report of ``refs`` (default ``@candidate``) against ``baseline_ref`` (default: the version
    under ``@baseline``, if any), at ``k`` or every evaluated k."""
    model = resolve_model(reader, model)
    versions = [resolve_version(reader, model, ref) for ref in refs or ["@candidate"]]
    if baseline_ref is not None:
        baseline = resolve_version(reader, model, baseline_ref)
    else:
        number = reader.alias(model, "baseline")
        baseline = None if number is None else reader.version(model, number)
    cache: dict[str, Any] = {}
    return {
        "model": model,
        "baseline": None if baseline is None else {"version": baseline.version, "label": _label(baseline)},
        "bootstrap": {"resamples": RESAMPLES, "seed": SEED, "confidence": 0.95, "unit": "prompt"},
        "rows": [row for version in versions for row in _rows(reader, version, baseline, k, cache)],
    }


def _format(value: float | None, signed: bool = False) -> str:
    return "n/a" if value is None else f"{value:+.3f}" if signed else f"{value:.3f}"


def _format_ci(ci: list[float | None] | None, signed: bool = False) -> str:
    return "" if not ci else f"[{_format(ci[0], signed)}, {_format(ci[1], signed)}]"


def _metric_name(name: str) -> str:
    return f"accept rate @{name.split('_')[1]}" if name.startswith("position_") else name.replace("_", " ")


def _notes(report: Mapping[str, Any]) -> list[str]:
    baseline = report["baseline"]["label"] if report["baseline"] else "none (no @baseline alias)"
    notes = [
        f"model {report['model']}, baseline {baseline}; 95% CI: bootstrap over prompts, "
        f"{report['bootstrap']['resamples']} resamples, seed {report['bootstrap']['seed']}"
    ]
    for row in report["rows"]:
        paired = f"baseline paired {row['pairing']}" if row["pairing"] else row["note"]
        greedy = "outputs equal greedy"
        if row["greedy_mismatches"]:
            greedy = f"{row['greedy_mismatches']} outputs DIFFER from greedy"
        elif row["greedy_unchecked"]:
            greedy = "outputs not checked against greedy (sampling)"
        notes.append(
            f"{row['label']} k={row['k']}: {row['prompts']} prompts on {row['target'] or 'an unnamed target'}, "
            f"evaluate run {row['evaluate_run_id']}, {paired}, {greedy}; {_engine_note(row['engine'])}"
        )
    return notes


def _cells(report: Mapping[str, Any], metrics: Sequence[str] | None = None) -> list[list[str]]:
    cells = []
    for row in report["rows"]:
        for name, entry in row["metrics"].items():
            if metrics is not None and name not in metrics:
                continue
            cells.append(
                [
                    row["label"],
                    str(row["k"]),
                    _metric_name(name),
                    _format(entry["value"]),
                    _format_ci(entry["ci"]),
                    _format(entry["baseline"]) if "baseline" in entry else "",
                    _format(entry["delta"], signed=True) if "delta" in entry else "",
                    _format_ci(entry.get("delta_ci"), signed=True),
                ]
            )
    return cells


def render_text(report: Mapping[str, Any]) -> str:
    """An aligned plain-text table, preceded by one line per version and k saying how it was measured."""
    return "\n".join([*_notes(report), "", *text_table([list(COLUMNS), *_cells(report)])])


def render_markdown(report: Mapping[str, Any], metrics: Sequence[str] | None = None) -> str:
    """The same report as Markdown (for pull requests and version descriptions): notes as a list, then a table of
    every metric, or of ``metrics`` only."""
    notes = [f"- {note}" for note in _notes(report)]
    return "\n".join([*notes, "", *markdown_table([list(COLUMNS), *_cells(report, metrics)])])


def render_json(report: Mapping[str, Any]) -> str:
    """The report as JSON (NaN-free: undefined numbers are null)."""
    return json.dumps(report, indent=2)
