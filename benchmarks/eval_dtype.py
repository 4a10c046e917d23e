"""The evaluate stage on a finished workspace, once per compute dtype: what bf16 does to speed and greedy equality.

Run in a project whose graph has run (``dvc repro`` or ``dvc exp run -S preset=quality``): it takes that
workspace's params.yaml (with its preset), verifier, responses, candidate and baseline, overrides only
``evaluate.dtype``, and runs the evaluate stage's own function into ``--work/<dtype>`` (each run is tracked in
MLflow like the stage). The dtypes take turns in one process, so the machine is the same for all. It reports,
per dtype, arm and k: tau, speedup over that dtype's no-speculation arm, greedy mismatches and tie flips (with the
largest tie gap in units in the last place).

  python benchmarks/eval_dtype.py --out benchmarks/results/quality_eval_dtype.json
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import click
from harness import greedy_equality, header, write_report

from expman.evaluation.evaluate import evaluate
from expman.params import load_params
from expman.paths import EvaluatePaths


def _arm_rows(evaluation: dict, arm: str) -> dict:
    """Per k: tau, speedup and greedy equality (mismatches, tie flips, largest tie gap)."""
    equality = greedy_equality(evaluation, arm)
    return {
        key: {"tau": values["tau"], "speedup": values["speedup"], **equality[key]}
        for key, values in evaluation["summary"][arm].items()
    }


@click.command()
@click.option("--dtype", "dtypes", multiple=True, default=["float32", "bfloat16"], show_default=True)
@click.option("--params", "params_file", type=click.Path(exists=True, path_type=Path), default="params.yaml")
@click.option("--work", type=click.Path(path_type=Path), default="data/eval_dtype", show_default=True)
@click.option("--out", type=click.Path(path_type=Path))
def main(dtypes: tuple[str, ...], params_file: Path, work: Path, out: Path | None) -> None:
    params = load_params(params_file)
    results = {}
    for dtype in dtypes:
        section = params.evaluate.model_copy(update={"dtype": dtype})
        started = time.perf_counter()
        folder = work / dtype
        where = replace(EvaluatePaths.default(), out=folder, metrics=folder / "summary.json", plots=folder / "plots")
        evaluate(params.model_copy(update={"evaluate": section}), where)
        evaluation = json.loads((folder / "evaluation.json").read_text())
        results[dtype] = {
            "seconds": time.perf_counter() - started,
            "nospec_tok_per_s": evaluation["summary"]["nospec"]["tok_per_s"],
            **{arm: _arm_rows(evaluation, arm) for arm in ("candidate", "baseline") if arm in evaluation["summary"]},
        }
    report = header("eval_dtype", "cpu") | {
        "preset": params.preset,
        "prompts": evaluation["summary"]["prompts"],
        "max_new_tokens": params.evaluate.max_new_tokens,
        "dtypes": results,
    }
    write_report(out, report)


if __name__ == "__main__":
    main()
