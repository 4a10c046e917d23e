"""extract: hidden-state shards + data/extract/manifest.json.  Run: python stages/extract.py (or dvc repro extract)."""

import click

from expman.data.extract import extract
from expman.errors import user_errors
from expman.params import load_params
from expman.paths import ExtractPaths


@click.command()
@click.option("--params", "params_file", default="params.yaml", show_default=True, help="params file")
def main(params_file: str) -> None:
    """Capture aux and final hidden states of the train responses; resumable shard by shard."""
    with user_errors():
        extract(load_params(params_file), ExtractPaths.default())


if __name__ == "__main__":
    main()
