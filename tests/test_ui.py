"""`expman ui` in headless Chromium over a store that expman's own stage runs and registry wrote.

The registered drafter's page must show its versions with their aliases and weights digests, the experiment's
runs page every stage run, and each run page a link to the run that produced its input, so that a user can walk
from the registered candidate back to prepare. Screenshots of every page go to ``$EXPMAN_TEST_ARTIFACTS/ui``
(default ``test-artifacts/ui``) for CI to keep. Without Chromium the test skips, unless EXPMAN_REQUIRE_SERVERS=1.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from expman.provenance import sha256_file, upstream_entry
from expman.registry.tracking import set_alias, stage_run
from expman.registry.versions import register_drafter
from tests.registry_fixtures import tiny_checkpoint, use_store
from tests.servers import free_port, unavailable

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
MODEL = "eagle3-ui-check"
EXPERIMENT = "ui-check"  # the DVC experiment name: stage runs are named ui-check/<stage>
RUN_LINK = re.compile(r"#/experiments/(\d+)/runs/([0-9a-f]{32})")
WALK = ("register", "train", "extract", "prepare")  # each run's description links to the next
EVALUATIONS = (  # two evaluate runs, with metrics named as the evaluate stage names them
    {"candidate/k3/tau": 1.357, "candidate/k3/speedup": 0.812, "baseline/k3/tau": 1.166},
    {"candidate/k3/tau": 1.624, "candidate/k3/speedup": 1.093, "baseline/k3/tau": 1.166},
)


def _browser() -> str:
    for name in BROWSERS:
        if path := shutil.which(name):
            return path
    unavailable("Chromium is not installed (apt-get install chromium)")


@dataclass
class Store:
    """What the UI must show: the experiment, the id of each stage's run (the last register run), version digests."""

    root: Path
    experiment_id: str
    runs: dict[str, str]
    shas: dict[int, str]


def _stage(
    name: str,
    inputs: dict[str, tuple[Path, dict]],
    registers: tuple[Path, str] | None = None,
    metrics: dict[str, float] | None = None,
) -> tuple:
    """One stage execution as the stages record it: a tagged run over its inputs' manifests, its own manifest, and,
    for ``registers`` (folder, alias), a version registered inside the run; ``metrics`` logged and shown in the
    runs table as the evaluate stage does."""
    upstream = {stage: upstream_entry(path) for stage, (path, _) in inputs.items()}
    with stage_run(name, {"stage": name}, upstream) as run:
        if metrics:
            run.log_metrics(metrics)
            run.show_columns(list(metrics))
        facts = {}
        if registers is not None:
            folder, alias = registers
            facts["version"] = register_drafter(run, folder, MODEL, alias, {})
        path = Path("out") / run.run_id / "manifest.json"
        return path, run.write_manifest(path, facts)


def build_store(root: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
    """In ``root``: prepare → generate → extract → vocab → baseline (v1 @baseline) → train → evaluate → register
    (v2), then v2 becomes @champion and a second register run adds v3 as @candidate."""
    import mlflow

    use_store(root, monkeypatch)
    monkeypatch.setenv("DVC_EXP_NAME", EXPERIMENT)
    drafters = [tiny_checkpoint(root / f"drafter-{seed}", seed) for seed in range(3)]
    prepare = _stage("prepare", {})
    generate = _stage("generate", {"prepare": prepare})
    extract = _stage("extract", {"prepare": prepare, "generate": generate})
    vocab = _stage("vocab", {"generate": generate})
    features = {"prepare": prepare, "extract": extract, "vocab": vocab}
    baseline = _stage("baseline", features, (drafters[0], "baseline"))
    train = _stage("train", features)
    evaluated = {"prepare": prepare, "generate": generate, "baseline": baseline, "candidate": train}
    evaluate = _stage("evaluate", evaluated, metrics=EVALUATIONS[0])
    inputs = {"prepare": prepare, "vocab": vocab, "train": train, "evaluate": evaluate}
    first = _stage("register", inputs, (drafters[1], "candidate"))
    set_alias(MODEL, "champion", first[1]["version"])
    inputs["evaluate"] = _stage("evaluate", evaluated, metrics=EVALUATIONS[1])
    register = _stage("register", inputs, (drafters[2], "candidate"))
    chain = {"prepare": prepare, "extract": extract, "train": train, "register": register}
    runs = {stage: manifest["provenance"]["mlflow_run_id"] for stage, (_, manifest) in chain.items()}
    runs |= {
        f"evaluate-{n}": manifest["provenance"]["mlflow_run_id"]
        for n, (_, manifest) in enumerate((evaluate, inputs["evaluate"]))
    }
    shas = {number: sha256_file(folder / "model.safetensors") for number, folder in enumerate(drafters, start=1)}
    return Store(root, mlflow.get_run(runs["prepare"]).info.experiment_id, runs, shas)


def _stop(server: subprocess.Popen, processes: list[Any]) -> None:
    """End the UI's whole process group (expman, mlflow, uvicorn and its workers): TERM, then KILL."""
    import psutil

    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, sig)
        _, alive = psutil.wait_procs(processes, timeout=20)
        if not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]:
            break
    server.wait(timeout=10)


@contextmanager
def serve_ui(root: Path, log_path: Path) -> Iterator[str]:
    """``expman ui`` in ``root`` on a free loopback port (it finds the project's mlflow.db, as a user's would);
    yields its URL. On exit it ends every process it started and checks that none is left."""
    import psutil

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"  # no background job workers: a page server is enough
    command = [sys.executable, "-c", "from expman.cli import main; main()", "ui", "--port", str(port)]
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    processes = [psutil.Process(server.pid)]
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, f"expman ui exited: {log_path.read_text()[-2000:]}"
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    break
            assert time.monotonic() < deadline, f"expman ui did not answer: {log_path.read_text()[-2000:]}"
            time.sleep(0.5)
        processes += processes[0].children(recursive=True)
        yield url
    finally:
        _stop(server, processes)
    left = [p.pid for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"UI processes still running after teardown: {left}"


class Page(HTMLParser):
    """A rendered page: its visible text (scripts and styles left out, whitespace collapsed), its links and the alt
    texts of its images."""

    def __init__(self, dom: str):
        super().__init__()
        self.chunks: list[str] = []
        self.links: list[tuple[str, str]] = []
        self.images: list[str] = []
        self.hidden = 0
        self.anchor: tuple[str, list[str]] | None = None
        self.feed(dom)
        self.text = " ".join(" ".join(self.chunks).split())

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("script", "style"):
            self.hidden += 1
        elif tag == "a":
            self.anchor = (dict(attrs).get("href") or "", [])
        elif tag == "img":
            self.images.append(dict(attrs).get("alt") or "")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style"):
            self.hidden -= 1
        elif tag == "a" and self.anchor is not None:
            self.links.append((self.anchor[0], " ".join("".join(self.anchor[1]).split())))
            self.anchor = None

    def handle_data(self, data: str) -> None:
        if not self.hidden:
            self.chunks.append(data)
            if self.anchor is not None:
                self.anchor[1].append(data)


def renderer(browser: str, profile: Path) -> Callable[[str, str], Page]:
    """``render(url, name)``: the page after MLflow's single-page app has fetched and drawn its data (Chromium's
    virtual time runs until the network is idle), with a screenshot ``<artifacts>/ui/<nn>-<name>.png``."""
    shots = Path(os.environ.get("EXPMAN_TEST_ARTIFACTS") or REPO / "test-artifacts") / "ui"
    shots.mkdir(parents=True, exist_ok=True)
    count = iter(range(100))

    def page(url: str, name: str) -> Page:
        shot = shots / f"{next(count):02d}-{name}.png"
        command = [
            browser,
            "--headless",
            "--no-sandbox",  # CI runs as root
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--disable-crash-reporter",
            "--no-first-run",
            f"--user-data-dir={profile}",
            "--window-size=1600,1100",
            "--virtual-time-budget=20000",
            f"--screenshot={shot}",
            "--dump-dom",
            url,
        ]
        chrome = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True
        )
        try:
            dom, _ = chrome.communicate(timeout=120)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(chrome.pid, signal.SIGKILL)  # helpers Chromium may leave behind
            chrome.wait()
        assert chrome.returncode == 0, f"chromium failed on {url}"
        assert shot.is_file(), f"no screenshot of {url}"
        return Page(dom)

    return page


def test_ui_shows_versions_aliases_and_the_stage_chain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    render = renderer(_browser(), tmp_path / "chromium")  # first: skips, or fails with EXPMAN_REQUIRE_SERVERS=1
    store = build_store(tmp_path, monkeypatch)
    with serve_ui(store.root, tmp_path / "ui.log") as ui:
        model = render(f"{ui}/#/models/{MODEL}", "model")
        assert MODEL in model.text
        rows = {
            int(m.group(1)): row
            for row in re.split(r"(?=Version \d+ )", model.text)
            if (m := re.match(r"Version (\d+) ", row))
        }
        assert sorted(rows) == [1, 2, 3], model.text
        aliases = {number: set(re.findall(r"@ (\w+)", row)) for number, row in rows.items()}
        assert aliases == {1: {"baseline"}, 2: {"champion"}, 3: {"candidate"}}, f"aliases shown: {aliases}"
        for number, sha in store.shas.items():
            assert sha in rows[number], f"v{number}: weights digest not shown"

        runs = render(f"{ui}/#/experiments/{store.experiment_id}/runs", "runs")
        for stage in ("prepare", "generate", "extract", "vocab", "baseline", "train", "evaluate", "register"):
            assert f"{EXPERIMENT}/{stage}" in runs.text, f"run of {stage} not listed"
        assert runs.text.count(f"{EXPERIMENT}/register") == 2

        # the table expman ui points at: each run's stage, and the evaluate runs' tau and speedup side by side
        link = re.search(r"stage runs \(stage, tau and speedup columns\): (\S+)", (tmp_path / "ui.log").read_text())
        assert link, "expman ui printed no link to the runs table"
        table = render(link.group(1), "runs-table")
        header = table.text.split("Hide run")[0]
        for column in ("expman.stage", "Duration", "baseline/k3/tau", "candidate/k3/speedup", "candidate/k3/tau"):
            assert column in header, f"runs table: no {column} column ({header[-300:]})"
        for values in EVALUATIONS:  # metric columns in name order, then the stage tag
            row = f"{values['baseline/k3/tau']} {values['candidate/k3/speedup']} {values['candidate/k3/tau']} evaluate"
            assert row in table.text, f"runs table: no row {row!r}"
        assert table.text.count(" - - - prepare") == 1  # the other stages show the stage and no metric

        # what "Compare" on the two evaluate runs opens: every metric, one column per run
        ids = json.dumps([store.runs["evaluate-0"], store.runs["evaluate-1"]])
        query = urllib.parse.urlencode({"runs": ids, "experiments": json.dumps([store.experiment_id])})
        compared = render(f"{ui}/#/compare-runs?{query}", "compare-evaluate")
        assert "Comparing 2 Runs" in compared.text, compared.text[:500]
        metrics = compared.text.split("Metrics Show diff only", 1)[1]
        names = "baseline/k3/tau candidate/k3/speedup candidate/k3/tau"
        first, second = EVALUATIONS
        side_by_side = " ".join(f"{first[name]} {second[name]}" for name in names.split())
        assert metrics.startswith(f" {names} {side_by_side}"), metrics[:300]

        version = render(f"{ui}/#/models/{MODEL}/versions/3", "version-3")
        sources = [href for href, text in version.links if text == f"{EXPERIMENT}/register"]
        assert sources and f"/runs/{store.runs['register']}" in sources[0], "v3's source run is not the register run"
        assert f"expman.upstream.train.run_id {store.runs['train']}" in version.text, "v3's lineage tags not shown"

        run_id = store.runs["register"]
        for stage, parent in zip(WALK, (*WALK[1:], None), strict=True):
            page = render(f"{ui}/#/experiments/{store.experiment_id}/runs/{run_id}", f"run-{stage}")
            assert f"expman stage {stage} ." in page.text, f"{run_id}: not the {stage} run"
            inputs = {text: link.group(2) for href, text in page.links if (link := RUN_LINK.fullmatch(href))}
            if stage == "register":
                assert f"{MODEL} v3" in page.text, "the register run does not show the version it registered"
            if parent is None:
                assert not [t for t in inputs if t.startswith(f"{EXPERIMENT}/")], "prepare has no inputs"
                break
            assert f"{EXPERIMENT}/{parent}" in inputs, f"{stage} run: no link to its {parent} input ({page.text[:500]})"
            run_id = inputs[f"{EXPERIMENT}/{parent}"]
            assert run_id == store.runs[parent], f"{stage} run links to the wrong {parent} run"
            assert f"expman.upstream.{parent}.run_id" in page.text, f"{stage} run: lineage tag not shown"
