"""train: the EAGLE-3 drafter into models/drafter.  Run: python stages/train.py (or dvc repro train)."""

import click

from expman import paths
from expman.errors import user_errors
from expman.params import load_params
from expman.train import train


@click.command()
@click.option("--params", "params_file", default="params.yaml", show_default=True, help="params file")
def main(params_file: str) -> None:
    """Train the drafter with the TTT unroll; resumes from models/.train-state after a kill."""
    with user_errors():
        train(
            load_params(params_file).train,
            paths.VERIFIER,
            paths.EXTRACT,
            paths.VOCAB,
            paths.DRAFTER,
            paths.TRAIN_STATE,
            paths.TRAIN_METRICS,
        )


if __name__ == "__main__":
    main()
