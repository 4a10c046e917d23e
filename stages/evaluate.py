"""evaluate: reference speculative decoding, three arms, into data/evaluate.  Run: python stages/evaluate.py."""

import click

from expman.errors import user_errors
from expman.evaluation.evaluate import evaluate
from expman.params import load_params
from expman.paths import EvaluatePaths


@click.command()
@click.option("--params", "params_file", default="params.yaml", show_default=True, help="params file")
def main(params_file: str) -> None:
    """No speculation, baseline and candidate on the held-out prompts: τ, acceptance, speedup, greedy equality."""
    with user_errors():
        evaluate(load_params(params_file), EvaluatePaths.default())


if __name__ == "__main__":
    main()
