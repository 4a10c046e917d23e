"""train: the EAGLE-3 drafter into models/drafter.  Run: python stages/train.py (or dvc repro train).

With ``train.gpus`` or ``train.nodes`` above 1 it starts itself under torchrun (``expman.training.parallel.launch``)."""

import sys

import click

from expman.errors import user_errors
from expman.params import load_params
from expman.paths import TrainPaths
from expman.training.parallel import launch
from expman.training.train import train


@click.command()
@click.option("--params", "params_file", default="params.yaml", show_default=True, help="params file")
def main(params_file: str) -> None:
    """Train the drafter with the TTT unroll; resumes from models/.train-state after a kill."""
    with user_errors():
        section = load_params(params_file).train
        exit_code = launch(section, sys.argv)
        if exit_code is None:
            train(section, TrainPaths.default())
    if exit_code:
        sys.exit(exit_code)


if __name__ == "__main__":
    main()
