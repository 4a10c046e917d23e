"""baseline: the drafter candidates are measured against, into models/baseline.  Run: python stages/baseline.py."""

import click

from expman import paths
from expman.baseline import baseline
from expman.errors import user_errors
from expman.params import load_params


@click.command()
@click.option("--params", "params_file", default="params.yaml", show_default=True, help="params file")
def main(params_file: str) -> None:
    """Train a small generic drafter (baseline.source: train) or import one; register it with alias baseline."""
    with user_errors():
        baseline(
            load_params(params_file),
            paths.VERIFIER,
            paths.EXTRACT,
            paths.VOCAB,
            paths.BASELINE,
            paths.BASELINE_STATE,
            paths.BASELINE_METRICS,
        )


if __name__ == "__main__":
    main()
