"""The ``expman`` command line. Heavy libraries are imported inside commands so ``expman --help`` is instant.

Results go to stdout; logs and progress bars to stderr; errors are one line with a non-zero exit code.
"""

from __future__ import annotations

import json

import click

from expman.errors import user_errors

__all__ = ["main"]


@click.group()
@click.version_option(package_name="expman")
def main() -> None:
    """Declarative experiment manager and registry for EAGLE-3 drafters (DVC graph + MLflow tracking)."""


@main.group()
def params() -> None:
    """Inspect and validate params.yaml."""


@params.command("check")
@click.option("--params", "params_file", default="params.yaml", show_default=True, help="params file")
@click.option("--json", "as_json", is_flag=True, help="print the resolved params as JSON")
def params_check(params_file: str, as_json: bool) -> None:
    """Validate every section of PARAMS against the schema, before any model loads."""
    from expman.params import load_params

    with user_errors():
        resolved = load_params(params_file)
    if as_json:
        click.echo(json.dumps(resolved.model_dump(), indent=2))
    else:
        click.echo(f"{params_file}: ok ({', '.join(type(resolved).model_fields)})")


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="interface to bind; 0.0.0.0 exposes it")
@click.option("--port", default=5000, show_default=True, type=int)
def ui(host: str, port: int) -> None:
    """Start the MLflow UI on the project's tracking store (MLFLOW_TRACKING_URI or ./mlflow.db)."""
    from expman.tracking import serve_ui

    with user_errors():
        serve_ui(host, port)
