"""benchmark: the arms in vLLM, engine τ vs reference τ, into data/benchmark.  Run: python stages/benchmark.py."""

import click

from expman.errors import user_errors
from expman.evaluation.benchmark import benchmark
from expman.params import load_params
from expman.paths import BenchmarkPaths


@click.command()
@click.option("--params", "params_file", default="params.yaml", show_default=True, help="params file")
def main(params_file: str) -> None:
    """No speculation, baseline and candidate in the serving engine; flag integration faults."""
    with user_errors():
        benchmark(load_params(params_file), BenchmarkPaths.default())


if __name__ == "__main__":  # vLLM's engine runs in a spawned process that re-imports this module
    main()
