"""Recipe screen: train one variant of the train section from scratch on the features already extracted, and
record its held-out simulated tau as a row of the tuning table.

Run from the project root after ``dvc repro`` (or ``dvc exp run -S preset=...``) has built the features:

  python benchmarks/recipe_screen.py --name lr1e-3 --set train.lr=0.001 --out benchmarks/results/quality_tuning.json
  python benchmarks/recipe_screen.py --name half --sample-share 0.5 --out ...   # data scaling: half the samples

A screen costs one training run (minutes on 2 CPU cores for the default graph) instead of a whole
``dvc exp run``; its winners go into a preset and are confirmed there by the reference evaluator and vLLM
(benchmarks/quality.py). Each screen is an MLflow run named ``screen-<name>`` in the project's store; a change to
the vocab section builds its own vocab under ``--work``, and one to the extract section its own extract manifest
there, over the features of its own key in the project's feature store. A row of the same name is replaced.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import click
import yaml
from harness import cpu_name, write_report

from expman import paths
from expman.data.extract import extract
from expman.data.vocab import vocab
from expman.params import Params, load_params
from expman.paths import ExtractPaths, TrainPaths, VocabPaths
from expman.training.train import train


def _with_changes(params: Params, changes: dict[str, Any]) -> Params:
    """``params`` with ``section.key`` values replaced, validated again by the params schema."""
    data = params.model_dump(mode="json", by_alias=True)
    for dotted, value in changes.items():
        section, _, key = dotted.partition(".")
        if section not in data or not isinstance(data[section], dict) or not key:
            raise click.BadParameter(f"{dotted}: expected <section>.<key> of params.yaml", param_hint="--set")
        data[section][key] = value
    return Params.model_validate(data, context={"root": Path.cwd()})


def _parse_set(_: Any, __: Any, values: tuple[str, ...]) -> dict[str, Any]:
    changes = {}
    for item in values:
        dotted, sep, raw = item.partition("=")
        if not sep:
            raise click.BadParameter(f"{item}: expected section.key=value", param_hint="--set")
        changes[dotted] = yaml.safe_load(raw)
    return changes


@click.command()
@click.option("--name", required=True, help="the row's name in the tuning table")
@click.option("--set", "changes", multiple=True, callback=_parse_set, help="section.key=value (YAML value)")
@click.option("--sample-share", default=1.0, show_default=True, type=click.FloatRange(0, 1, min_open=True))
@click.option("--params", "params_file", default="params.yaml", show_default=True)
@click.option(
    "--work", type=click.Path(file_okay=False, path_type=Path), default=Path("data/screens"), show_default=True
)
@click.option("--out", type=click.Path(path_type=Path), required=True, help="the tuning table JSON")
def main(name: str, changes: dict[str, Any], sample_share: float, params_file: str, work: Path, out: Path) -> None:
    params = _with_changes(load_params(params_file), {"train.finetune_from": None, **changes})
    folder = work / name
    vocab_dir, extract_dir = paths.VOCAB, paths.EXTRACT
    if any(key.startswith("vocab.") for key in changes):
        vocab_dir = folder / "vocab"
        vocab(params, VocabPaths(paths.GENERATED, vocab_dir))
    if any(key.startswith("extract.") for key in changes):
        extract_dir = folder / "extract"
        extract(params, ExtractPaths(paths.VERIFIER, paths.GENERATED, extract_dir))
    started = time.perf_counter()
    where = replace(
        TrainPaths.default(),
        extract=extract_dir,
        vocab=vocab_dir,
        out=folder / "drafter",
        state=folder / ".train-state",
        metrics=folder / "train.json",
        plots=None,
    )
    train(params.train, where, stage=f"screen-{name}", sample_share=sample_share)
    seconds = time.perf_counter() - started
    metrics = json.loads((folder / "train.json").read_text())
    steps = params.train.ttt_steps
    row = {
        "name": name,
        "command": "python benchmarks/recipe_screen.py --name "
        + name
        + "".join(f" --set {k}={json.dumps(v)}" for k, v in changes.items())
        + (f" --sample-share {sample_share}" if sample_share != 1.0 else "")
        + f" --out {out}",
        "preset": params.preset,
        "changes": changes,
        "sample_share": sample_share,
        "train_samples": metrics["train_samples"],
        "measured_by": "train's held-out split: simulated tau from conditional accuracy per TTT step",
        "sim_tau": {f"k{k}": metrics[f"sim_tau_k{k}"] for k in range(1, steps + 1)},
        "cond_acc": [metrics[f"cond_acc_{i}"] for i in range(steps)],
        "train_seconds": seconds,
    }
    table = json.loads(out.read_text()) if out.is_file() else {"benchmark": "quality_tuning", "rows": []}
    table["device"] = cpu_name()
    table["rows"] = [r for r in table["rows"] if r["name"] != name] + [row]
    write_report(out, table)


if __name__ == "__main__":
    main()
