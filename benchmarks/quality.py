"""Drafter quality of the quality preset, per prompt category and k, with the peer trained side by side.

Run from the project root (a git + DVC checkout with the engine extra and the peer's packages installed):

  python benchmarks/quality.py --peer ../shared/bench/peer_quality --out benchmarks/results/quality_cpu.json

Steps, each kept under ``--work`` and skipped when already done there (a killed run resumes; the peer's feature
extraction is a step of its own, so a run killed in the peer's training resumes with its features):
  1. ``dvc exp run -S preset=quality`` (or ``--preset``): the whole graph; candidate (finetuned from the baseline)
     and baseline in the reference evaluator at evaluate.ks and in vLLM at benchmark.ks.
  2. scratch: the preset's train section from scratch (``finetune_from: null``) on the same features.
  3. peer: ../shared/bench/peer_quality trains speculators' own Eagle3DraftModel and loss on the same train
     responses (converted to its format), with the same aux layers, draft vocab size and TTT steps, for the same
     training wall time as the scratch drafter.
  4. judging, one step per ``--eval-prompts`` count: the scratch drafter as the only drafter in the reference
     evaluator at evaluate.ks and in vLLM at benchmark.ks; the peer's in vLLM CPU at k = evaluate.ks; both on the
     same held-out prompts with the same number of new tokens. The preset's 16 prompts keep the graph inside its
     hour; all 96 shrink the sampling error of the ratio by about √6.
The goal ratio (τ(k=3) − 1, scratch over peer) is given twice: scratch in the reference evaluator, and scratch in
vLLM, the engine the peer is measured in.
Every expman step is an MLflow run in the project's store.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import click
from harness import cpu_name, greedy_equality, header, write_report

from expman import paths
from expman.data.generate import read_responses
from expman.evaluation.evaluate import evaluate, select_prompts
from expman.params import Params, load_params
from expman.paths import BenchmarkPaths, EvaluatePaths, TrainPaths
from expman.provenance import read_manifest


def _step(done: Path, run: Any) -> dict[str, Any]:
    """Run ``run`` unless ``done`` (its facts JSON) exists; time it and keep its facts there."""
    if done.is_file():
        return json.loads(done.read_text())
    started = time.perf_counter()
    facts = run() or {}
    facts["seconds"] = time.perf_counter() - started
    done.parent.mkdir(parents=True, exist_ok=True)
    done.write_text(json.dumps(facts, indent=2))
    return facts


def _repro(preset: str) -> dict[str, Any]:
    subprocess.run([sys.executable, "-m", "dvc", "exp", "run", "-S", f"preset={preset}"], check=True)
    return {"command": f"dvc exp run -S preset={preset}"}


def _train_scratch(params: Params, folder: Path) -> dict[str, Any]:
    """Train the preset's train section from scratch into ``folder``/drafter."""
    from expman.training.train import train

    section = params.train.model_copy(update={"finetune_from": None})
    started = time.perf_counter()
    train(
        section,
        replace(
            TrainPaths.default(),
            out=folder / "drafter",
            state=folder / ".train-state",
            metrics=folder / "train.json",
            plots=None,
        ),
    )
    return {"train_s": time.perf_counter() - started}


def _evaluate_scratch(judged: Params, folder: Path, tag: str) -> dict[str, Any]:
    """Evaluate and benchmark the scratch drafter as the only drafter arm, on ``judged``'s held-out prompts."""
    from expman.evaluation.benchmark import benchmark

    evaluated = folder / f"evaluate_{tag}"
    evaluate(
        judged,
        replace(
            EvaluatePaths.default(),
            drafter=folder / "drafter",
            out=evaluated,
            metrics=folder / f"evaluate_{tag}.json",
            plots=folder / f"plots_{tag}",
        ),
    )
    benchmark(
        judged,
        replace(
            BenchmarkPaths.default(),
            evaluate=evaluated,
            out=folder / f"benchmark_{tag}",
            metrics=folder / f"benchmark_{tag}.json",
        ),
    )
    return {}


class _Peer:
    """The peer pipeline on expman's own train responses and held-out prompts, its scripts run from ``peer``."""

    def __init__(self, params: Params, peer: Path, folder: Path):
        self.params, self.peer, self.folder = params, peer, folder
        contract = read_manifest(paths.EXTRACT / "manifest.json", "extract")["contract"]
        self.layers = ",".join(str(i) for i in contract["aux_layers"])
        self.vocab_size = str(read_manifest(paths.VOCAB / "manifest.json", "vocab")["draft_vocab_size"])

    def script(self, name: str, *args: str, log: str) -> None:
        with open(self.folder / log, "w") as out:
            subprocess.run(
                [sys.executable, str(self.peer / name), *args], check=True, stdout=out, stderr=subprocess.STDOUT
            )

    def extract(self) -> dict[str, Any]:
        """Convert the responses and held-out prompts to the peer's format; extract its features."""
        folder = self.folder
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "train_responses.jsonl", "w") as handle:
            for r in read_responses(paths.GENERATED, "train"):
                user = [m["content"] for m in r["messages"] if m["role"] == "user"][-1]
                cut = r["prompt_tokens"]
                row = {
                    "id": r["id"],
                    "prompt": user,
                    "prompt_ids": r["input_ids"][:cut],
                    "response_ids": r["input_ids"][cut:],
                }
                handle.write(json.dumps(row) + "\n")
        self.write_prompts(folder / "heldout_all.jsonl", None)
        started = time.perf_counter()
        self.script(
            "extract_features.py",
            str(paths.VERIFIER),
            str(folder / "train_responses.jsonl"),
            str(folder / "feats"),
            "--exclude",
            str(folder / "heldout_all.jsonl"),
            "--layers",
            self.layers,
            "--draft-vocab",
            self.vocab_size,
            log="extract.log",
        )
        return {"extract_s": time.perf_counter() - started}

    def write_prompts(self, path: Path, limit: int | None) -> None:
        """Up to ``limit`` held-out prompts (all with None), chosen as the reference evaluator chooses them."""
        heldout = read_responses(paths.GENERATED, self.params.evaluate.split)
        with open(path, "w") as handle:
            for r in select_prompts(heldout, limit):
                user = [m["content"] for m in r["messages"] if m["role"] == "user"][-1]
                handle.write(json.dumps({"id": r["id"], "category": r["category"], "prompt": user}) + "\n")

    def train(self, budget_s: float) -> dict[str, Any]:
        """Train on the extracted features within ``budget_s``."""
        folder = self.folder
        started = time.perf_counter()
        self.script(
            "train_drafter.py",
            str(paths.VERIFIER),
            str(folder / "feats"),
            str(folder / "drafter"),
            "--budget-s",
            f"{budget_s:.0f}",
            "--max-len",
            str(self.params.train.max_tokens),
            "--layers",
            self.layers,
            "--draft-vocab",
            self.vocab_size,
            "--ttt",
            str(self.params.train.ttt_steps),
            log="train.log",
        )
        return {"train_s": time.perf_counter() - started, "budget_s": budget_s}

    def evaluate(self, judged: Params, tag: str) -> dict[str, Any]:
        """vLLM CPU with the peer's drafter on ``judged``'s held-out prompts, at its ks and new tokens."""
        prompts = self.folder / f"prompts_{tag}.jsonl"
        self.write_prompts(prompts, judged.evaluate.max_prompts)
        self.script(
            "eval_vllm.py",
            str(paths.VERIFIER),
            str(prompts),
            str(self.folder / "drafter"),
            str(self.folder / f"eval_{tag}.json"),
            "--arms",
            ",".join(["nospec", *(f"k{k}" for k in judged.evaluate.ks)]),
            "--max-tokens",
            str(judged.evaluate.max_new_tokens),
            log=f"eval_{tag}.log",
        )
        return {}


def _prompt_count(value: str) -> int | None:
    """``--eval-prompts``: a positive number, or all (None)."""
    if value == "all":
        return None
    if not value.isdigit() or int(value) < 1:
        raise click.BadParameter(f"{value!r}: a positive number of prompts or all", param_hint="--eval-prompts")
    return int(value)


def _reference(evaluation: dict, arm: str) -> dict[str, Any]:
    summary = evaluation["summary"]
    keep = ("tau", "per_position", "speedup")
    equality = greedy_equality(evaluation, arm)
    return {
        "dtype": evaluation["dtype"],
        "overall": {k: {**{x: v[x] for x in keep}, **equality[k]} for k, v in summary[arm].items()},
        "by_category": {c: {k: v["tau"] for k, v in block[arm].items()} for c, block in summary["by_category"].items()},
    }


def _engine(bench: dict, arm: str) -> dict[str, Any]:
    return {
        f"k{k}": {x: v["engine"][x] for x in ("tau", "per_position", "speedup")}
        for k, v in bench["arms"][arm]["k"].items()
    }


@click.command()
@click.option("--peer", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True)
@click.option("--preset", default="quality", show_default=True)
@click.option(
    "--work", type=click.Path(file_okay=False, path_type=Path), default=Path("data/quality"), show_default=True
)
@click.option(
    "--peer-budget-s",
    type=float,
    help="The peer's training budget; default: the scratch drafter's training time. The peer turns it into whole "
    "epochs from its first steps' time, so when that leaves most of an epoch unused, give it more and compare the "
    "training times it reports (seconds.peer_train against seconds.scratch_train).",
)
@click.option(
    "--eval-prompts",
    default=None,
    help="Held-out prompts the scratch and peer drafters are judged on: a number (round-robin over categories, as "
    "evaluate.max_prompts) or all; default: the preset's evaluate.max_prompts. Each count is a step of its own, so "
    "a rerun with another count reuses both drafters.",
)
@click.option("--out", type=click.Path(path_type=Path), required=True)
def main(peer: Path, preset: str, work: Path, peer_budget_s: float | None, eval_prompts: str | None, out: Path) -> None:
    repro = _step(work / "repro.json", lambda: _repro(preset))
    params = load_params("params.yaml")
    if params.preset != preset:
        raise click.ClickException(f"params.yaml: preset is {params.preset!r} after the run, not {preset!r}")
    prompts = params.evaluate.max_prompts if eval_prompts is None else _prompt_count(eval_prompts)
    tag = "all" if prompts is None else str(prompts)
    judged = params.model_copy(
        update={"evaluate": params.evaluate.model_copy(update={"baseline": None, "max_prompts": prompts})}
    )
    scratch = _step(work / "scratch.json", lambda: _train_scratch(params, work / "scratch"))
    scratch_judged = _step(work / f"scratch_eval_{tag}.json", lambda: _evaluate_scratch(judged, work / "scratch", tag))
    budget_s = scratch["train_s"] if peer_budget_s is None else peer_budget_s
    peer_run = _Peer(params, peer, work / "peer")
    peer_extract = _step(work / "peer_extract.json", peer_run.extract)
    theirs = _step(work / "peer.json", lambda: peer_run.train(budget_s))
    peer_judged = _step(work / f"peer_eval_{tag}.json", lambda: peer_run.evaluate(judged, tag))

    evaluation = json.loads((paths.EVALUATE / "evaluation.json").read_text())
    bench = json.loads((paths.BENCHMARK / "benchmark.json").read_text())
    scratch_eval = json.loads((work / f"scratch/evaluate_{tag}/evaluation.json").read_text())
    scratch_bench = json.loads((work / f"scratch/benchmark_{tag}/benchmark.json").read_text())
    peer_eval = json.loads((work / f"peer/eval_{tag}.json").read_text())
    reference = {arm: _reference(evaluation, arm) for arm in ("candidate", "baseline")}
    reference["scratch"] = _reference(scratch_eval, "candidate")
    engine = {arm: _engine(bench, arm) for arm in ("candidate", "baseline")}
    engine["scratch"] = _engine(scratch_bench, "candidate")
    engine["peer"] = {
        arm: {
            "tau": r["tau"],
            "per_position": r["per_pos_rate"],
            "speedup": r["tok_per_s"] / peer_eval["nospec"]["tok_per_s"],
        }
        for arm, r in peer_eval.items()
        if arm != "nospec" and "tau" in r
    }
    extract = read_manifest(paths.EXTRACT / "manifest.json", "extract")
    tau3 = {arm: reference[arm]["overall"]["k3"]["tau"] for arm in reference}
    goals = {
        "scratch_vs_peer_tau3_minus_1_ratio": (tau3["scratch"] - 1) / (engine["peer"]["k3"]["tau"] - 1),
        "scratch_vs_peer_vllm_tau3_minus_1_ratio": (engine["scratch"]["k3"]["tau"] - 1)
        / (engine["peer"]["k3"]["tau"] - 1),
        "candidate_tau3": tau3["candidate"],
        "candidate_minus_baseline_tau3": tau3["candidate"] - tau3["baseline"],
        "candidate_reference_speedup_best": max(v["speedup"] for v in reference["candidate"]["overall"].values()),
        "candidate_vllm_over_reference_tau3": engine["candidate"]["k3"]["tau"] / tau3["candidate"]
        if "k3" in engine["candidate"]
        else None,
    }
    report = header("quality") | {
        "device": cpu_name(),
        "cpu_threads": os.cpu_count(),
        "preset": preset,
        "params": params.model_dump(mode="json", by_alias=True),
        "data": {**extract["totals"], "train_responses": len(read_responses(paths.GENERATED, "train"))},
        "seconds": {
            "repro": repro["seconds"],
            "scratch_train": scratch["train_s"],
            "scratch_evaluate": scratch_judged["seconds"],
            "peer_extract": peer_extract["extract_s"],
            "peer_train": theirs["train_s"],
            "peer_train_budget": theirs["budget_s"],
            "peer_evaluate": peer_judged["seconds"],
        },
        "heldout_prompts": {
            "candidate_and_baseline": len(evaluation["prompts"]),
            "scratch_and_peer": len(scratch_eval["prompts"]),
        },
        "reference": reference,
        "vllm": engine,
        "goals": goals,
    }
    write_report(out, report)


if __name__ == "__main__":
    main()
