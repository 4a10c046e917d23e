"""Speculative-decoding acceptance counters read from vLLM, in the units of the reference evaluator.

vLLM (0.32, ``vllm/v1/spec_decode/metrics.py``) keeps four cumulative Prometheus counters per engine:
``vllm:spec_decode_num_drafts`` (verification rounds), ``..._num_draft_tokens``, ``..._num_accepted_tokens`` and
``..._num_accepted_tokens_per_pos`` (label ``position``; how many rounds accepted at least position i + 1). They
never reset while the engine lives, so an arm's numbers are the difference of two snapshots taken around it.
Offline, ``LLM.get_metrics()`` returns them as ``Counter``/``Vector`` objects (``vllm/v1/metrics/reader.py``); a
server exposes them on ``/metrics`` with the ``_total`` suffix. Label sets (one per engine under data
parallelism) are summed. Pure Python: nothing here imports vLLM.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from expman.errors import ExpmanError

__all__ = ["AcceptanceCounters", "from_prometheus_text", "from_vllm_metrics"]

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
SCALAR_COUNTERS = {DRAFTS: "drafts", DRAFT_TOKENS: "draft_tokens", ACCEPTED_TOKENS: "accepted_tokens"}

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class AcceptanceCounters:
    """Cumulative acceptance counters: rounds, drafted and accepted tokens, and rounds accepting each position."""

    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: tuple[int, ...]

    def _rounds(self) -> int:
        if self.drafts <= 0:
            raise ExpmanError("spec-decode counters: no verification rounds recorded (speculation off or no requests)")
        return self.drafts

    @property
    def tau(self) -> float:
        """Mean tokens per verification round, the bonus token included: 1 + accepted / rounds."""
        return 1 + self.accepted_tokens / self._rounds()

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens."""
        if self.draft_tokens <= 0:
            raise ExpmanError("spec-decode counters: no draft tokens recorded (speculation off or no requests)")
        return self.accepted_tokens / self.draft_tokens

    @property
    def per_position_rates(self) -> list[float]:
        """Share of rounds that accepted draft position i (unconditional: positions 0..i all accepted)."""
        rounds = self._rounds()
        return [count / rounds for count in self.accepted_per_position]

    def summary(self) -> dict[str, Any]:
        """τ, acceptance rate and per-position rates under the keys the reference evaluator writes."""
        return {"tau": self.tau, "acceptance_rate": self.acceptance_rate, "per_position": self.per_position_rates}

    def __sub__(self, earlier: AcceptanceCounters) -> AcceptanceCounters:
        """The counts between two snapshots (``later - earlier``); a count that went down means a reset."""
        length = max(len(self.accepted_per_position), len(earlier.accepted_per_position))
        names = ["drafts", "draft_tokens", "accepted_tokens", *(f"accepted_per_position[{i}]" for i in range(length))]
        before, after = (
            [c.drafts, c.draft_tokens, c.accepted_tokens, *_padded(c.accepted_per_position, length)]
            for c in (earlier, self)
        )
        for name, old, new in zip(names, before, after, strict=True):
            if new < old:
                raise ExpmanError(
                    f"spec-decode counter {name} went down from {old} to {new}: the engine restarted or its "
                    "counters were reset between the snapshots"
                )
        deltas = [new - old for old, new in zip(before, after, strict=True)]
        return AcceptanceCounters(*deltas[:3], accepted_per_position=tuple(deltas[3:]))


def _padded(counts: tuple[int, ...], length: int) -> tuple[int, ...]:
    return counts + (0,) * (length - len(counts))


class _Totals:
    """Sums counter samples over label sets (engines) and positions."""

    def __init__(self) -> None:
        self.scalars: dict[str, int] = {}
        self.positions: dict[int, int] = {}

    def add_scalar(self, name: str, value: float) -> None:
        self.scalars[name] = self.scalars.get(name, 0) + int(value)

    def add_position(self, position: int, value: float) -> None:
        self.positions[position] = self.positions.get(position, 0) + int(value)

    def counters(self, source: str) -> AcceptanceCounters:
        if not self.scalars and not self.positions:
            raise ExpmanError(f"{source}: no vllm:spec_decode_* counters (speculative decoding off or stats disabled)")
        missing = [name for name in SCALAR_COUNTERS if name not in self.scalars]
        if not self.positions:
            missing.append(ACCEPTED_PER_POSITION)
        if missing:
            raise ExpmanError(f"{source}: missing counter {missing[0]}")
        length = max(self.positions) + 1
        return AcceptanceCounters(
            **{field: self.scalars[name] for name, field in SCALAR_COUNTERS.items()},
            accepted_per_position=tuple(self.positions.get(i, 0) for i in range(length)),
        )


def _base_name(name: str) -> str:
    return name.removesuffix("_total")


def from_vllm_metrics(metrics: Iterable[Any]) -> AcceptanceCounters:
    """Counters from ``LLM.get_metrics()``: ``Counter`` objects (``.name``, ``.labels``, ``.value``) and the
    per-position ``Vector`` (``.values``); a per-position ``Counter`` labelled ``position`` is accepted too.
    Duck-typed: any objects with those attributes do."""
    totals = _Totals()
    for metric in metrics:
        name = _base_name(metric.name)
        if name in SCALAR_COUNTERS:
            totals.add_scalar(name, metric.value)
        elif name == ACCEPTED_PER_POSITION:
            values = getattr(metric, "values", None)
            if values is None:
                totals.add_position(int(metric.labels["position"]), metric.value)
            else:
                for position, value in enumerate(values):
                    totals.add_position(position, value)
    return totals.counters("LLM.get_metrics()")


def from_prometheus_text(text: str) -> AcceptanceCounters:
    """Counters from a vLLM server's ``/metrics`` scrape (Prometheus text format, ``_total`` samples)."""
    totals = _Totals()
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if not match or not match["name"].endswith("_total"):
            continue
        name = _base_name(match["name"])
        if name not in SCALAR_COUNTERS and name != ACCEPTED_PER_POSITION:
            continue
        try:
            value = float(match["value"])
        except ValueError:
            raise ExpmanError(f"/metrics: {match['name']} has a non-numeric value {match['value']!r}") from None
        if name == ACCEPTED_PER_POSITION:
            labels = dict(_LABEL.findall(match["labels"] or ""))
            if "position" not in labels:
                raise ExpmanError(f"/metrics: {match['name']} sample without a position label")
            totals.add_position(int(labels["position"]), value)
        else:
            totals.add_scalar(name, value)
    return totals.counters("/metrics")
