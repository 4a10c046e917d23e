"""baseline: the drafter candidates are measured against, into models/baseline.  Run: python stages/baseline.py.

A trained baseline with ``baseline.train.gpus`` or ``nodes`` above 1 starts itself under torchrun, as train does."""

import sys

import click

from expman.errors import user_errors
from expman.params import load_params
from expman.paths import TrainPaths
from expman.training.baseline import baseline
from expman.training.parallel import launch


@click.command()
@click.option("--params", "params_file", default="params.yaml", show_default=True, help="params file")
def main(params_file: str) -> None:
    """Train a small generic drafter (baseline.source: train) or import one; register it with alias baseline."""
    with user_errors():
        params = load_params(params_file)
        exit_code = launch(params.baseline.train, sys.argv) if params.baseline.source == "train" else None
        if exit_code is None:
            baseline(params, TrainPaths.baseline())
    if exit_code:
        sys.exit(exit_code)


if __name__ == "__main__":
    main()
