"""generate: regenerate responses into data/generated.  Run: python stages/generate.py (or dvc repro generate)."""

import click

from expman.data.generate import generate
from expman.errors import user_errors
from expman.params import load_params
from expman.paths import GeneratePaths


@click.command()
@click.option("--params", "params_file", default="params.yaml", show_default=True, help="params file")
def main(params_file: str) -> None:
    """Answer every prompt with the verifier and its chat template; resumable shard by shard."""
    with user_errors():
        generate(load_params(params_file), GeneratePaths.default())


if __name__ == "__main__":  # the vLLM backend spawns its engine process
    main()
