"""Kill trials: SIGKILL generate, extract and train at random moments, rerun, and compare with an uninterrupted run.

A tiny project (the tests' random Llama verifier, 320 long train prompts, 4 held-out) runs prepare once. Then, per
stage in graph order: one uninterrupted reference run from empty outputs, and ``--trials`` trials, each from
empty outputs: start the stage as dvc would (``python stages/<stage>.py`` in the project, own process group,
``--threads`` torch threads: two threads on a loaded 2-core machine made train 5x slower than one),
SIGKILL the group at a moment drawn uniformly (seeded) from the window in which the reference run was writing (from
its first output file to its final manifest, watched every 20 ms), then rerun it to the end. A kill that lands
before any output or after the stage finished is not a trial: the outputs are cleared and a new moment drawn, up to
``--attempts`` times, and every attempt's landing is counted. Each trial records where its kill landed: files and
progress (shards or step) written, and the temp files a write in progress left. A trial passes when the rerun exits 0
and every file under the stage's output roots has the reference's digest.
After a stage's trials its reference outputs are put back, so the next stage reads exactly what it would have.

Digests: sha256 of the bytes of every file under the roots, hidden files included (a temp file a kill leaves
behind is a difference). Manifests are compared byte for byte too: they hold only content (the run id, argv and
packages of each execution are in its MLflow run). One exclusion: ``created`` in a feature set's ``set.json``,
the time the set was published. Extract's roots are ``data/extract`` and the project's feature store
(``.expman/features``: the published set, or the ``<key>.partial`` folder a kill leaves). The train roots are all
of ``models/`` (minus the verifier, its input) and ``metrics/``: atomic_dir writes the drafter through a temp
folder beside ``models/drafter``.

  python benchmarks/kill_trials.py --out benchmarks/results/kill_trials.json
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import click
import yaml
from harness import cpu_name, header, write_report

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.conftest: the tiny random verifier and tiny params the tests use

from expman.provenance import sha256_file  # noqa: E402
from tests.conftest import make_tiny_verifier, tiny_params, write_prompts  # noqa: E402

PROMPTS = {"train": 320, "heldout": 4}
JOIN = 8  # a train prompt is 8 shipped prompts joined (~450 tokens): work for extract and train, not only start-up
OVERRIDES = {  # each stage works about as long as it starts up, and writes many shards / checkpoints
    "generate": {"max_new_tokens": 16, "batch_size": 8, "shard_size": 8},
    "extract": {"samples_per_shard": 4, "batch_tokens": 2048},
    # from scratch: no baseline stage to run first; a finetune only changes the initial weights, not the resume
    "train": {"epochs": 2, "checkpoint_every": 10, "log_every": 10, "finetune_from": None},
}


@dataclass(frozen=True)
class Stage:
    """What a stage writes: the roots digested and cleared, inputs inside them, the manifest written last."""

    name: str
    roots: tuple[str, ...]
    final: str
    keep: tuple[str, ...] = ()

    def files(self, project: Path) -> list[Path]:
        """Every file under the roots, hidden ones included, inputs left out."""
        found = []
        for root in self.roots:
            path = project / root
            candidates = [path] if path.is_file() else path.rglob("*")
            for file in candidates:
                relative = file.relative_to(project).as_posix()
                if file.is_file() and not any(relative.startswith(f"{k}/") for k in self.keep):
                    found.append(file)
        return sorted(found)

    def clear(self, project: Path) -> None:
        """Empty the roots (inputs kept): the state before a fresh run."""
        for root in self.roots:
            path = project / root
            for entry in path.iterdir() if path.is_dir() else []:
                if entry.relative_to(project).as_posix() in self.keep:
                    continue
                if entry.is_dir():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()

    def progress(self, project: Path) -> int:
        """Shards with a sidecar (generate, extract) or the step of the saved train state."""
        if self.name != "train":
            return sum(len(list((project / r).rglob("*.done.json"))) for r in self.roots)
        state = project / "models/.train-state/state.pt"
        if not state.is_file():
            return 0
        import torch

        return int(torch.load(state, weights_only=True, map_location="cpu")["step"])


PHASES = ("before_output", "mid_output", "after_completion")
WATCH_EVERY = 0.02

STAGES = [
    Stage("generate", ("data/generated", "data/.generate-state"), "data/generated/manifest.json"),
    Stage("extract", ("data/extract", ".expman/features"), "data/extract/manifest.json"),
    Stage("train", ("models", "metrics"), "models/drafter/manifest.json", keep=("models/verifier",)),
]


def digest(file: Path) -> str:
    """sha256 of the file; for a feature set's set.json, of its canonical JSON without the time it was published."""
    if file.name != "set.json":
        return sha256_file(file)
    facts = json.loads(file.read_text(encoding="utf-8"))
    facts.pop("created", None)
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


def digests(project: Path, stage: Stage) -> dict[str, str]:
    """Relative path -> digest of every file the stage wrote."""
    return {f.relative_to(project).as_posix(): digest(f) for f in stage.files(project)}


def differences(got: dict[str, str], want: dict[str, str]) -> list[str]:
    """One line per missing, extra or changed file."""
    return [
        f"{'missing' if path not in got else 'extra' if path not in want else 'changed'}: {path}"
        for path in sorted(got.keys() | want.keys())
        if got.get(path) != want.get(path)
    ]


def start(project: Path, stage: str, log: Path) -> subprocess.Popen:
    """``python stages/<stage>.py`` in the project, as dvc runs it, in its own process group."""
    ignored = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "EXPMAN_FEATURE_STORE")  # the project's own stores
    env = {k: v for k, v in os.environ.items() if k not in ignored}
    env |= {"GIT_CEILING_DIRECTORIES": str(project.parent), "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "ab") as handle:
        return subprocess.Popen(
            [sys.executable, f"stages/{stage}.py"],
            cwd=project,
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def run(project: Path, stage: str, log: Path) -> tuple[int, float]:
    """Run a stage to the end; return its exit code and seconds."""
    started = time.perf_counter()
    code = start(project, stage, log).wait()
    return code, time.perf_counter() - started


def write_long_prompts(folder: Path, split: str, count: int) -> None:
    """``count`` prompts of ``split``, each a shipped prompt and the next ``JOIN - 1`` ones joined."""
    lines = (REPO / f"data/prompts/{split}.jsonl").read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines]
    with open(folder / f"{split}.jsonl", "w", encoding="utf-8") as handle:
        for index, row in enumerate(rows[:count]):
            prompt = " ".join(rows[(index + k) % len(rows)]["prompt"] for k in range(JOIN))
            handle.write(json.dumps(row | {"prompt": prompt}) + "\n")


def setup(project: Path) -> None:
    """The tiny verifier, the prompts, params.yaml and the stage scripts, in an empty project folder."""
    make_tiny_verifier(project / "tiny-verifier")
    (project / "prompts").mkdir()
    write_long_prompts(project / "prompts", "train", PROMPTS["train"])
    write_prompts(project / "prompts", "heldout", PROMPTS["heldout"])
    params = tiny_params("tiny-verifier")
    for section, values in OVERRIDES.items():
        params[section].update(values)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    shutil.copytree(REPO / "stages", project / "stages")


def must_run(project: Path, stage: str, log: Path) -> float:
    """Run a stage that has to succeed; return its seconds."""
    code, seconds = run(project, stage, log)
    if code:
        raise click.ClickException(f"{stage} failed (exit {code}); see {log}")
    return seconds


def landing(project: Path, stage: Stage, exit_code: int | None) -> str:
    """Where a kill landed: before any output, while the stage was writing, or after it had finished."""
    if exit_code is not None or (project / stage.final).is_file():
        return "after_completion"
    return "mid_output" if stage.files(project) else "before_output"


def watched(project: Path, stage: Stage, log: Path) -> tuple[float, tuple[float, float]]:
    """Run a stage to the end, watching its outputs; return its seconds and when it wrote its first and last file."""
    started = time.perf_counter()
    process = start(project, stage.name, log)
    first = final = None
    while process.poll() is None:
        now = time.perf_counter() - started
        if first is None and stage.files(project):
            first = now
        if final is None and (project / stage.final).is_file():
            final = now
        time.sleep(WATCH_EVERY)
    seconds = time.perf_counter() - started
    if process.returncode:
        raise click.ClickException(f"{stage.name} failed (exit {process.returncode}); see {log}")
    return seconds, (first or 0.0, final or seconds)


def trial(
    project: Path,
    stage: Stage,
    window: tuple[float, float],
    attempts: int,
    reference: dict[str, str],
    log: Path,
    rng: random.Random,
) -> dict:
    """Kills at moments drawn from ``window`` until one lands while the stage writes, then a rerun to the end."""
    tried = []
    for _ in range(attempts):
        stage.clear(project)
        kill_at = rng.uniform(*window)
        process = start(project, stage.name, log)
        try:
            exit_code = process.wait(timeout=kill_at)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            exit_code = None
        tried.append({"kill_at_s": round(kill_at, 3), "phase": landing(project, stage, exit_code)})
        if tried[-1]["phase"] == "mid_output":
            break
    written = stage.files(project)
    at_kill = {
        "files": len(written),
        "progress": stage.progress(project),
        "temp_files": [f.relative_to(project).as_posix() for f in written if f.name.endswith(".tmp")],
    }
    code, seconds = run(project, stage.name, log)
    found = differences(digests(project, stage), reference) if code == 0 else [f"rerun exit code {code}"]
    return {
        "kill_at_s": tried[-1]["kill_at_s"],
        "phase": tried[-1]["phase"],
        "attempts": tried,
        "at_kill": at_kill,
        "rerun_exit_code": code,
        "rerun_s": round(seconds, 3),
        "equal": not found,
        "differences": found,
    }


def stage_trials(
    project: Path, stage: Stage, upstream: list[Stage], trials: int, attempts: int, rng: random.Random
) -> dict:
    """The reference run, the kill trials, and the reference outputs put back; upstream digests checked."""
    log = project / f"logs/{stage.name}.log"
    before = {s.name: digests(project, s) for s in upstream}
    stage.clear(project)
    fresh_s, window = watched(project, stage, log)
    reference = digests(project, stage)
    saved = project.parent / f"reference-{stage.name}"
    for root in stage.roots:
        shutil.copytree(project / root, saved / root, symlinks=True)
    results = []
    for index in range(trials):
        results.append(trial(project, stage, window, attempts, reference, log, rng))
        click.echo(f"{stage.name} trial {index}: {json.dumps(results[-1])}", err=True)
    stage.clear(project)
    for root in stage.roots:
        shutil.copytree(saved / root, project / root, symlinks=True, dirs_exist_ok=True)
    if digests(project, stage) != reference:
        raise click.ClickException(f"{stage.name}: the reference outputs could not be put back")
    phases = {p: sum(r["phase"] == p for r in results) for p in PHASES}
    attempted = [a["phase"] for r in results for a in r["attempts"]]
    mid = [r["rerun_s"] for r in results if r["phase"] == "mid_output"]
    return {
        "trials": trials,
        "all_equal": all(r["equal"] for r in results),
        "upstream_intact": all(digests(project, s) == before[s.name] for s in upstream),
        "fresh_s": round(fresh_s, 3),
        "writing_window_s": [round(t, 3) for t in window],
        "rerun_s": {
            "median": round(statistics.median(r["rerun_s"] for r in results), 3),
            "median_after_mid_output_kill": round(statistics.median(mid), 3) if mid else None,
        },
        "phases": phases,
        "attempt_phases": {p: attempted.count(p) for p in PHASES},
        "interrupted_while_writing": phases["mid_output"],
        "killed_mid_file": sum(bool(r["at_kill"]["temp_files"]) for r in results),
        "reference": {
            "files": len(reference),
            "bytes": sum(f.stat().st_size for f in stage.files(project)),
            "progress": stage.progress(project),
        },
        "kill_at_s": [r["kill_at_s"] for r in results],
        "runs": results,
    }


@click.command()
@click.option("--trials", default=10, show_default=True, help="kill trials per stage")
@click.option("--seed", default=0, show_default=True, help="seed of the kill moments")
@click.option("--attempts", default=8, show_default=True, help="kills per trial until one lands while it writes")
@click.option("--threads", default=1, show_default=True, help="torch threads of the stages (OMP_NUM_THREADS)")
@click.option("--workdir", type=click.Path(path_type=Path), default=None, help="keep the project here")
@click.option("--out", type=click.Path(path_type=Path), default=None)
def main(trials: int, attempts: int, seed: int, threads: int, workdir: Path | None, out: Path | None) -> None:
    started = time.perf_counter()
    os.environ["OMP_NUM_THREADS"] = str(threads)  # the stages inherit it
    load_before = os.getloadavg()
    base = workdir or Path(tempfile.mkdtemp(prefix="expman-kill-"))
    project = base / "project"
    project.mkdir(parents=True)
    (project / "logs").mkdir()
    setup(project)
    must_run(project, "prepare", project / "logs/prepare.log")
    rng = random.Random(seed)
    stages = {}
    for index, stage in enumerate(STAGES):
        if stage.name == "train":
            must_run(project, "vocab", project / "logs/vocab.log")
        stages[stage.name] = stage_trials(project, stage, STAGES[:index], trials, attempts, rng)
    report = header("kill_trials") | {
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "load_average_1m": {"start": load_before[0], "end": os.getloadavg()[0]},
        "project": {
            "prompts": PROMPTS,
            "train_prompt_joins": JOIN,
            "params": OVERRIDES,
            "verifier": "tests.conftest.make_tiny_verifier",
        },
        "seed": seed,
        "attempts_per_trial": attempts,
        "threads": threads,
        "all_equal": all(s["all_equal"] and s["upstream_intact"] for s in stages.values()),
        "all_interrupted_while_writing": all(s["interrupted_while_writing"] == trials for s in stages.values()),
        "stages": stages,
        "total_s": round(time.perf_counter() - started, 1),
    }
    if workdir is None:
        shutil.rmtree(base)
    write_report(out, report)


if __name__ == "__main__":
    main()
