"""prepare: resolve the verifier into models/verifier.  Run: python stages/prepare.py (or dvc repro prepare)."""

import click

from expman import paths
from expman.data.verifier import prepare
from expman.errors import user_errors
from expman.params import load_params


@click.command()
@click.option("--params", "params_file", default="params.yaml", show_default=True, help="params file")
def main(params_file: str) -> None:
    """Dequantize or copy the verifier into an HF safetensors folder and record its contract facts."""
    with user_errors():
        prepare(load_params(params_file), paths.VERIFIER)


if __name__ == "__main__":
    main()
