"""evaluate: reference speculative decoding, three arms, into data/evaluate.  Run: python stages/evaluate.py."""

import click

from expman import paths
from expman.errors import user_errors
from expman.evaluation.evaluate import evaluate
from expman.params import load_params


@click.command()
@click.option("--params", "params_file", default="params.yaml", show_default=True, help="params file")
def main(params_file: str) -> None:
    """No speculation, baseline and candidate on the held-out prompts: τ, acceptance, speedup, greedy equality."""
    with user_errors():
        evaluate(
            load_params(params_file),
            paths.VERIFIER,
            paths.GENERATED,
            paths.DRAFTER,
            paths.EVALUATE,
            paths.EVALUATE_METRICS,
            paths.EVALUATE_PLOTS,
        )


if __name__ == "__main__":
    main()
