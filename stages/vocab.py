"""vocab: draft vocab into data/vocab.  Run: python stages/vocab.py (or dvc repro vocab)."""

import click

from expman.data.vocab import vocab
from expman.errors import user_errors
from expman.params import load_params
from expman.paths import VocabPaths


@click.command()
@click.option("--params", "params_file", default="params.yaml", show_default=True, help="params file")
def main(params_file: str) -> None:
    """Pick the draft vocab by assistant-token frequency; write d2t/t2d and coverage metrics."""
    with user_errors():
        vocab(load_params(params_file), VocabPaths.default())


if __name__ == "__main__":
    main()
