"""register: models/drafter as a new registry version.  Run: python stages/register.py (or dvc repro register)."""

import click

from expman.errors import user_errors
from expman.params import load_params
from expman.paths import RegisterPaths
from expman.registry.register import register


@click.command()
@click.option("--params", "params_file", default="params.yaml", show_default=True, help="params file")
def main(params_file: str) -> None:
    """Register models/drafter with its lineage, capture contract and evaluation numbers; move alias candidate."""
    with user_errors():
        register(load_params(params_file).register_, RegisterPaths.default())


if __name__ == "__main__":
    main()
