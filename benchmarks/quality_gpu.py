"""The whole graph on one GPU as a user runs it (``dvc exp run -S preset=gpu``, real DVC and MLflow), and its
report: stage times, data sizes, reference τ per k and per category, and the engine's τ of the same drafter.

A machine that runs a command for at most a few minutes at a time runs the graph in several calls; each call
resumes where the last one stopped (generate and extract by shard, train from its last checkpoint, evaluate
by prompt):

  python benchmarks/quality_gpu.py run --deadline-s 540     # exits 75 at the deadline: run it again

Keep the deadline under the call's limit with room for what the call does after it: a call cut at its limit leaves
its ``dvc exp run`` running or exiting, holding DVC's lock; the next ``run`` waits for it (within its deadline).
  python benchmarks/quality_gpu.py report --device-seconds 1500 --out benchmarks/results/quality_gpu_h200.json

Then the engine's τ of the same drafters, where vLLM is installed. A machine that returns files in pieces of a few
MB brings the drafters back without their ``embed_tokens`` (a copy of the verifier's, 113 of SmolLM2's 152 MB), and
the evaluation with the held-out split it was made on (what the benchmark stage reads besides the drafters):

  python benchmarks/quality_gpu.py pack --arm drafter --out $OUT        # on the GPU machine; baseline too
  python benchmarks/quality_gpu.py pack-evaluation --out $OUT
  python benchmarks/quality_gpu.py unpack --arm drafter --pieces DIR    # here, after prepare with preset: gpu;
  python benchmarks/quality_gpu.py unpack-evaluation --pieces DIR       # the weights' sha256 must match
  python stages/benchmark.py                                            # with benchmark.engine: vllm
  python benchmarks/quality_gpu.py engine --out benchmarks/results/quality_gpu_h200.json
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click
from harness import cpu_flags, cpu_name, write_report

STAGES = ("prepare", "generate", "extract", "vocab", "baseline", "train", "evaluate", "benchmark", "register")
INTERRUPTED = 75  # EX_TEMPFAIL: stopped at the deadline, run again
CALLS = Path(".quality_gpu_calls.json")  # one row per `run` call, beside the project's other local state
RWLOCK = Path(".dvc/tmp/rwlock")  # DVC's record of the processes that hold the project's outputs
KEPT = Path(".quality_gpu_kept")  # git-ignored: the graph's unignored outputs as the last call left them
KEPT_PATHS = ("dvc.lock", "metrics", "plots")
"""A machine that mirrors the working tree at each call deletes untracked files that are not ignored: without
dvc.lock `dvc exp run` reran every stage from scratch (baseline and train from step 0), and without a stage's
metrics or plots (``cache: false`` outputs) it reruns that stage."""


@click.group()
def main() -> None:
    """Run the GPU preset's graph across calls, and report it."""


@main.command()
@click.option("--deadline-s", type=float, default=540.0, help="Interrupt the graph cleanly after this long.")
@click.option("--preset", default="gpu")
@click.option("--target", default=None, help="Run the graph up to this stage only.")
@click.option("--set", "overrides", multiple=True, help="To dvc exp run -S: presets/gpu.yaml:train.lr=3e-4")
def run(deadline_s: float, preset: str, target: str | None, overrides: tuple[str, ...]) -> None:
    """``dvc exp run -S preset=<preset>`` until it finishes or the deadline; an interrupted stage resumes next time."""
    started = time.time()
    if not _wait_for_lock_holders(deadline_s):
        click.echo(f"an earlier dvc run still holds {RWLOCK} at the deadline: run again")
        sys.exit(INTERRUPTED)
    restore_kept()
    settings = [arg for override in (f"preset={preset}", *overrides) for arg in ("-S", override)]
    command = ["dvc", "exp", "run", *settings, *([target] if target else [])]
    process = subprocess.Popen(command, start_new_session=True)
    interrupted = False
    try:
        code = process.wait(timeout=max(deadline_s - (time.time() - started), 1.0))
    except subprocess.TimeoutExpired:
        interrupted = True
        os.killpg(process.pid, signal.SIGINT)  # the stage's KeyboardInterrupt; shards and checkpoints stay
        try:
            code = process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            code = process.wait()
    keep()
    calls = json.loads(CALLS.read_text()) if CALLS.is_file() else []
    seconds = time.time() - started
    calls.append({"command": command, "started": started, "seconds": seconds, "interrupted": interrupted})
    CALLS.write_text(json.dumps(calls, indent=1))
    if interrupted:
        click.echo(f"graph interrupted at the deadline ({seconds:.0f} s): run again to resume")
        sys.exit(INTERRUPTED)
    click.echo("graph finished" if code == 0 else f"graph failed (exit {code})")
    sys.exit(code)


def keep() -> None:
    """Copy dvc.lock, metrics/ and plots/ into KEPT, replacing the copies an earlier call kept."""
    for name in KEPT_PATHS:
        if Path(name).exists():
            _copy_whole(Path(name), KEPT / name)


def restore_kept() -> None:
    """Put back what KEPT holds and the working tree lacks (a mirrored tree lost it); never overwrite."""
    for name in KEPT_PATHS:
        if (KEPT / name).exists() and not Path(name).exists():
            _copy_whole(KEPT / name, Path(name))
            click.echo(f"{name} restored from {KEPT}")


def _copy_whole(source: Path, target: Path) -> None:
    """Copy a file or folder so that ``target`` is never half-written (a call cut at its limit)."""
    from expman.provenance import atomic_dir, atomic_write

    if source.is_dir():
        with atomic_dir(target) as tmp:
            shutil.copytree(source, tmp, dirs_exist_ok=True)
    else:
        atomic_write(target, lambda tmp: shutil.copyfile(source, tmp))


def lock_holders() -> set[int]:
    """The live processes named in DVC's rwlock: a call cut at its time limit leaves its ``dvc exp run`` exiting
    (or still running the graph), and a second run started meanwhile is refused as busy."""
    try:
        lock = json.loads(RWLOCK.read_text())
    except (OSError, ValueError):
        return set()
    # DVC's format: {"write": {path: {"pid", "cmd"}}, "read": {path: [{"pid", "cmd"}, ...]}}
    holders = [*lock.get("write", {}).values(), *(h for hs in lock.get("read", {}).values() for h in hs)]
    return {h["pid"] for h in holders if _alive(h["pid"])}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


def _wait_for_lock_holders(seconds: float) -> bool:
    """Wait up to ``seconds`` for the processes holding DVC's lock to exit; whether they did."""
    until = time.time() + seconds
    holders = lock_holders()
    if holders:
        click.echo(f"waiting for the earlier dvc run (pids {sorted(holders)}) to release {RWLOCK}")
    while holders and time.time() < until:
        time.sleep(2)
        holders = lock_holders()
    return not holders


def _stage_runs() -> dict[str, list[dict[str, Any]]]:
    """Per stage, its MLflow runs in this project's store, oldest first: status, seconds, the DVC experiment that
    ran it (none for a stage script run by hand) and the commit; for a training stage, each epoch's rate and share
    spent waiting for the feed."""
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{Path('mlflow.db').resolve()}")
    stages: dict[str, list[dict[str, Any]]] = {}
    runs = mlflow.search_runs(search_all_experiments=True, output_format="list")
    for run in sorted(runs, key=lambda r: r.info.start_time):
        stage = run.data.tags.get("expman.stage")
        if stage is None or run.info.end_time is None:
            continue
        stages.setdefault(stage, []).append(
            {
                "status": run.info.status,
                "seconds": (run.info.end_time - run.info.start_time) / 1000,
                "dvc_experiment": run.data.tags.get("dvc.exp_name"),
                "git_sha": run.data.tags.get("git.sha"),
                **({"epochs": _epochs(run.info.run_id)} if stage in ("baseline", "train") else {}),
            }
        )
    return {stage: stages[stage] for stage in STAGES if stage in stages}


def _epochs(run_id: str) -> list[dict[str, Any]]:
    """The training run's ``epoch_tok_per_s`` and ``epoch_input_wait`` (absent before the stage logged it), by epoch."""
    from mlflow import MlflowClient

    client = MlflowClient()
    rates = {m.step: m.value for m in client.get_metric_history(run_id, "epoch_tok_per_s")}
    waits = {m.step: m.value for m in client.get_metric_history(run_id, "epoch_input_wait")}
    return [{"epoch": e, "tok_per_s": rates[e], "input_wait": waits.get(e)} for e in sorted(rates)]


def _data_sizes() -> dict[str, Any]:
    generated = json.loads(Path("data/generated/manifest.json").read_text())
    extracted = json.loads(Path("data/extract/manifest.json").read_text())
    splits = {
        split: {key: facts[key] for key in ("records", "failed", "prompt_tokens", "response_tokens")}
        for split, facts in generated["splits"].items()
    }
    written = generated.get("self_prompts")
    facts = ("candidates", "kept", "kept_by_category", "dropped", "settings")
    return {
        "generated": splits,
        "self_prompts": None if written is None else {key: written[key] for key in facts if key in written},
        "extract": {**extracted["totals"], "bytes": extracted["storage"]["bytes"]},
    }


def _tau(evaluation: dict[str, Any]) -> dict[str, Any]:
    """Reference τ per arm and k, overall and per held-out category, from the evaluate stage's evaluation.json."""
    summary = evaluation["summary"]
    arms = list(evaluation["arms"])

    def per_k(block: dict[str, Any]) -> dict[str, dict[str, float]]:
        return {arm: {key: values["tau"] for key, values in block[arm].items()} for arm in arms}

    return {
        "prompts": summary["prompts"],
        "timed_prompts": summary.get("timed_prompts"),  # the prompts speedup comes from (evaluate.timed_prompts)
        "tau": per_k(summary),
        "speedup": {arm: {key: v["speedup"] for key, v in summary[arm].items()} for arm in arms},
        "tau_by_category": {c: per_k(block) for c, block in summary["by_category"].items()},
        "greedy_mismatches": {arm: {k: v["greedy_mismatches"] for k, v in summary[arm].items()} for arm in arms},
    }


def _train_metrics() -> dict[str, Any]:
    """Train's simulated τ on its validation samples (from the train split), per drafter that was trained here."""
    rows = {}
    for name in ("baseline", "train"):
        path = Path(f"metrics/{name}.json")
        if path.is_file():
            metrics = json.loads(path.read_text())
            rows[name] = {key: metrics[key] for key in metrics if key.startswith("sim_tau") or key.endswith("samples")}
    return rows


@main.command()
@click.option("--device-seconds", type=float, default=None, help="Device time the whole graph used, starts included.")
@click.option("--device", "device_name", default=None, help="The GPU it ran on (default: this machine's).")
@click.option("--device-cpu", default=None, help="The GPU host's CPU, when the report is made elsewhere.")
@click.option("--note", default=None, help="What the numbers do not say by themselves (overrides, interruptions).")
@click.option("--out", type=click.Path(path_type=Path), default=None)
def report(
    device_seconds: float | None,
    device_name: str | None,
    device_cpu: str | None,
    note: str | None,
    out: Path | None,
) -> None:
    """Collect the graph's stage times, data sizes and τ into one JSON (merged into ``--out``'s)."""
    import torch

    restore_kept()  # a mirrored tree lost metrics/ since the last run: train's validation τ lives there
    result: dict[str, Any] = json.loads(out.read_text()) if out is not None and out.is_file() else {}
    result.update(
        benchmark="quality_gpu",
        command="dvc exp run -S preset=gpu (python benchmarks/quality_gpu.py run, once per device call)",
        device=device_name or (torch.cuda.get_device_name() if torch.cuda.is_available() else cpu_name()),
        device_cpu=device_cpu or f"{cpu_name()} ({', '.join(cpu_flags())}), {os.cpu_count()} threads",
        device_seconds=device_seconds,
        **({"note": note} if note else {}),
        stages=_stage_runs(),
        data=_data_sizes(),
        train_validation=_train_metrics(),
        calls=json.loads(CALLS.read_text()) if CALLS.is_file() else [],
    )
    for key in ("candidate_tau_k3", "baseline_tau_k3", "vllm_cpu_tau_k3"):
        result.setdefault(key, None)  # None: not measured (yet)
    evaluation_file = Path("data/evaluate/evaluation.json")
    if evaluation_file.is_file():
        evaluation = json.loads(evaluation_file.read_text())
        tau = _tau(evaluation)
        result["candidate_tau_k3"] = tau["tau"]["candidate"].get("k3")
        result["baseline_tau_k3"] = tau["tau"].get("baseline", {}).get("k3")  # None: evaluated without that arm
        result["evaluate"] = {"device": evaluation["device"], "dtype": evaluation["dtype"], **tau}
    write_report(out, result, machine=device_name is None and device_cpu is None)


@main.command()
@click.option(
    "--benchmark",
    "benchmark_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=Path("data/benchmark/benchmark.json"),
    show_default=True,
)
@click.option("--out", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True)
def engine(benchmark_file: Path, out: Path) -> None:
    """Add the engine's τ of the returned drafters (the benchmark stage, run here) to the report made on the GPU
    machine; the rest of the report is left as it is."""
    result = json.loads(out.read_text())
    bench = json.loads(benchmark_file.read_text())
    arms = bench["arms"]
    result["vllm_cpu_tau_k3"] = arms["candidate"]["k"].get("3", {}).get("engine", {}).get("tau")
    result["engine"] = {
        "where": f"{cpu_name()} ({', '.join(cpu_flags())}), {os.cpu_count()} threads",
        "engine": bench["engine"],
        "tau": {name: {k: v["engine"]["tau"] for k, v in arm["k"].items()} for name, arm in arms.items()},
        "reference_tau": {name: {k: v["reference"]["tau"] for k, v in a["k"].items()} for name, a in arms.items()},
        "integration_fault": {name: arm.get("integration_fault") for name, arm in arms.items()},
    }
    write_report(out, result, machine=False)


PIECE_BYTES = 15_000_000
EMBEDDING = "embed_tokens.weight"


@main.command()
@click.option("--arm", type=click.Choice(["drafter", "baseline"]), required=True)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True)
def pack(arm: str, out: Path) -> None:
    """models/<arm>/model.safetensors without its embedding (checked equal to the verifier's), in pieces, with the
    sha256 of the whole file that ``unpack`` must rebuild and the folder's small files (config, manifest) whole."""
    import hashlib

    import torch
    from safetensors.torch import load_file, save_file

    whole = Path(f"models/{arm}/model.safetensors")
    tensors = load_file(whole)
    verifier = load_file("models/verifier/model.safetensors")
    if not torch.equal(tensors.pop(EMBEDDING), verifier["model.embed_tokens.weight"]):
        raise click.ClickException(f"{whole}: {EMBEDDING} is not the verifier's; send the whole file")
    stripped = out / f"{arm}.stripped.safetensors"
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, stripped, metadata={"format": "pt"})
    data = stripped.read_bytes()
    stripped.unlink()
    pieces = [data[i : i + PIECE_BYTES] for i in range(0, len(data), PIECE_BYTES)]
    for index, piece in enumerate(pieces):
        (out / f"{arm}.part{index}").write_bytes(piece)
    digest = hashlib.sha256(whole.read_bytes()).hexdigest()
    small = {p.name: p.read_text() for p in sorted(whole.parent.iterdir()) if p.is_file() and p != whole}
    (out / f"{arm}.json").write_text(json.dumps({"sha256": digest, "pieces": len(pieces), "files": small}))
    click.echo(f"{arm}: {len(pieces)} pieces, {len(data)} bytes without the embedding; sha256 {digest}")


@main.command()
@click.option("--arm", type=click.Choice(["drafter", "baseline"]), required=True)
@click.option("--pieces", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True)
def unpack(arm: str, pieces: Path) -> None:
    """Rebuild models/<arm>/ from ``pack``'s pieces, its small files and this project's prepared verifier; refuse
    unless the weights' sha256 equals the packed file's."""
    import hashlib

    from safetensors.torch import load, load_file, save_file

    facts = json.loads((pieces / f"{arm}.json").read_text())
    data = b"".join((pieces / f"{arm}.part{i}").read_bytes() for i in range(facts["pieces"]))
    tensors = load(data)
    tensors[EMBEDDING] = load_file("models/verifier/model.safetensors")["model.embed_tokens.weight"]
    whole = Path(f"models/{arm}/model.safetensors")
    whole.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, whole, metadata={"format": "pt"})
    digest = hashlib.sha256(whole.read_bytes()).hexdigest()
    if digest != facts["sha256"]:
        whole.unlink()
        raise click.ClickException(f"{whole}: rebuilt sha256 {digest} is not the packed {facts['sha256']}")
    for name, text in facts.get("files", {}).items():
        (whole.parent / name).write_text(text)
    click.echo(f"{whole}: sha256 {digest}, equal to the packed file")


EVALUATION_PACK = "evaluation.pack.json"


def _evaluation_files() -> list[Path]:
    """What the benchmark stage reads besides the drafters: the evaluation, its manifest, the generate manifest
    and the shards of the split it was made on (a few hundred kB, all text)."""
    manifest = json.loads(Path("data/evaluate/manifest.json").read_text())
    split = Path("data/generated") / manifest["params"]["split"]
    fixed = [Path("data/evaluate/evaluation.json"), Path("data/evaluate/manifest.json")]
    shards = sorted(p for p in split.iterdir() if p.is_file() and not p.name.startswith("."))
    return [*fixed, Path("data/generated/manifest.json"), *shards]


@main.command("pack-evaluation")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True)
def pack_evaluation(out: Path) -> None:
    """The evaluation and the held-out split it was made on, in one file, for the engine benchmark elsewhere."""
    files = {str(path): path.read_text() for path in _evaluation_files()}
    out.mkdir(parents=True, exist_ok=True)
    (out / EVALUATION_PACK).write_text(json.dumps(files))
    click.echo(f"{out / EVALUATION_PACK}: {', '.join(files)}")


@main.command("unpack-evaluation")
@click.option("--pieces", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True)
def unpack_evaluation(pieces: Path) -> None:
    """Write the packed evaluation files into this project; the split's shards are checked by their manifest when
    the benchmark stage reads them."""
    from expman.provenance import atomic_write

    files = json.loads((pieces / EVALUATION_PACK).read_text())
    for name, text in files.items():
        path = Path(name)
        if path.is_absolute() or ".." in path.parts or path.parts[0] != "data":
            raise click.ClickException(f"{pieces / EVALUATION_PACK}: {name} is not a path under data/")
        atomic_write(path, lambda tmp, text=text: tmp.write_text(text))
    click.echo(f"{len(files)} files written: {', '.join(files)}")


if __name__ == "__main__":
    main()
