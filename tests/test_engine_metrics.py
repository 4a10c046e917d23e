"""vLLM acceptance counters: τ math on hand-computed numbers, snapshot deltas, reset detection, and parsing of
recorded ``/metrics`` text and ``LLM.get_metrics()`` output.

The fixtures were recorded with vLLM 0.32's own code, without an engine: the four spec-decode counters were built
as ``vllm/v1/spec_decode/metrics.py:SpecDecodingProm`` builds them (labels ``model_name``, ``engine``; per-position
adds ``position``; here two engines, as under data parallelism, k = 3), exposed with prometheus_client's
``generate_latest`` (the ``/metrics`` text, from the first vllm metric on) and read back with
``vllm/v1/metrics/reader.py:get_metrics_snapshot`` (what ``LLM.get_metrics()`` returns, saved as JSON with each
object's class name). A gauge, a histogram and another counter ride along, as in a real scrape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from expman.engines.metrics import AcceptanceCounters, from_prometheus_text, from_vllm_metrics
from expman.errors import ExpmanError

FIXTURES = Path(__file__).parent / "fixtures"


# Stand-ins with exactly the fields of vllm/v1/metrics/reader.py's dataclasses (vllm 0.32.0).
@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Vector(Metric):
    values: list[int]


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int]


STAND_INS = {cls.__name__: cls for cls in (Counter, Vector, Gauge, Histogram)}


def recorded_get_metrics(moment: str) -> list[Metric]:
    records = json.loads((FIXTURES / f"vllm_get_metrics_{moment}.json").read_text())
    return [STAND_INS[record.pop("type")](**record) for record in records]


def recorded_scrape(moment: str) -> str:
    return (FIXTURES / f"vllm_metrics_{moment}.txt").read_text()


# Engine 0 + engine 1 in the recordings.
BEFORE = AcceptanceCounters(780, 2340, 273, (199, 55, 19))
AFTER = AcceptanceCounters(2710, 8130, 963, (705, 190, 68))


def test_tau_acceptance_and_per_position_on_hand_computed_counts():
    # 4 rounds of k=3 accepting 3, 2, 1, 0 drafts: 6 accepted of 12; tau = (4 + 3 + 2 + 1) / 4.
    counters = AcceptanceCounters(drafts=4, draft_tokens=12, accepted_tokens=6, accepted_per_position=(3, 2, 1))
    assert counters.tau == 2.5
    assert counters.acceptance_rate == 0.5
    assert counters.per_position_rates == [0.75, 0.5, 0.25]
    assert counters.summary() == {"tau": 2.5, "acceptance_rate": 0.5, "per_position": [0.75, 0.5, 0.25]}


def test_no_rounds_is_an_error_not_a_tau_of_one():
    with pytest.raises(ExpmanError, match="no verification rounds"):
        _ = AcceptanceCounters(0, 0, 0, (0, 0, 0)).tau


def test_prometheus_scrape_sums_engines_and_positions():
    assert from_prometheus_text(recorded_scrape("before")) == BEFORE
    assert from_prometheus_text(recorded_scrape("after")) == AFTER


def test_get_metrics_objects_give_the_same_counters_as_the_scrape():
    assert from_vllm_metrics(recorded_get_metrics("before")) == BEFORE
    assert from_vllm_metrics(recorded_get_metrics("after")) == AFTER


def test_delta_of_two_snapshots_is_the_arm():
    arm = from_prometheus_text(recorded_scrape("after")) - from_prometheus_text(recorded_scrape("before"))
    assert arm == AcceptanceCounters(1930, 5790, 690, (506, 135, 49))
    assert arm.tau == pytest.approx(1 + 690 / 1930)
    assert arm.acceptance_rate == pytest.approx(690 / 5790)
    assert arm.per_position_rates == pytest.approx([506 / 1930, 135 / 1930, 49 / 1930])


def test_delta_pads_per_position_vectors_of_different_lengths():
    delta = AcceptanceCounters(10, 30, 9, (5, 3, 1)) - AcceptanceCounters(2, 2, 1, (1,))
    assert delta == AcceptanceCounters(8, 28, 8, (4, 3, 1))


def test_counters_going_down_mean_a_reset():
    with pytest.raises(ExpmanError, match="drafts went down from 2710 to 780"):
        _ = BEFORE - AFTER
    with pytest.raises(ExpmanError, match=r"accepted_per_position\[1\] went down"):
        _ = AcceptanceCounters(10, 30, 9, (6, 2, 1)) - AcceptanceCounters(9, 27, 8, (5, 3, 0))


def test_total_suffix_and_position_labelled_counters_are_accepted():
    labels = {"model_name": "m", "engine": "0"}
    metrics = [
        Counter("vllm:spec_decode_num_drafts_total", labels, 10),
        Counter("vllm:spec_decode_num_draft_tokens_total", labels, 20),
        Counter("vllm:spec_decode_num_accepted_tokens_total", labels, 7),
        Counter("vllm:spec_decode_num_accepted_tokens_per_pos_total", {**labels, "position": "1"}, 2),
        Counter("vllm:spec_decode_num_accepted_tokens_per_pos_total", {**labels, "position": "0"}, 5),
    ]
    assert from_vllm_metrics(metrics) == AcceptanceCounters(10, 20, 7, (5, 2))


def test_missing_counters_are_named():
    without_drafts = [m for m in recorded_get_metrics("after") if m.name != "vllm:spec_decode_num_drafts"]
    with pytest.raises(ExpmanError, match="missing counter vllm:spec_decode_num_drafts$"):
        from_vllm_metrics(without_drafts)
    scrape = "\n".join(line for line in recorded_scrape("after").splitlines() if "_per_pos" not in line)
    with pytest.raises(ExpmanError, match="missing counter vllm:spec_decode_num_accepted_tokens_per_pos"):
        from_prometheus_text(scrape)
    no_speculation = [m for m in recorded_get_metrics("after") if not m.name.startswith("vllm:spec_decode")]
    with pytest.raises(ExpmanError, match="speculative decoding off"):
        from_vllm_metrics(no_speculation)
