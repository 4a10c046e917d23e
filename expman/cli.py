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
        click.echo(json.dumps(resolved.model_dump(by_alias=True), indent=2))
    else:
        sections = (field.alias or name for name, field in type(resolved).model_fields.items())
        click.echo(f"{params_file}: ok ({', '.join(sections)})")


@main.command()
@click.option("--params", "params_file", default="params.yaml", show_default=True, help="params file")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def doctor(params_file: str, as_json: bool) -> None:
    """Check GPU memory holders, free disk for extract, the capture contract across manifest, checkpoints and
    registry, and library versions; each problem comes with the command that fixes it. Exit code 1 on an error."""
    from pathlib import Path

    from expman.doctor import diagnose, render_json, render_text

    findings = diagnose(Path(params_file))
    click.echo(render_json(findings) if as_json else render_text(findings))
    if any(f.level == "error" for f in findings):
        raise SystemExit(1)


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="interface to bind; 0.0.0.0 exposes it")
@click.option("--port", default=5000, show_default=True, type=int)
def ui(host: str, port: int) -> None:
    """Start the MLflow UI on the project's tracking store (MLFLOW_TRACKING_URI or ./mlflow.db)."""
    from expman.registry.tracking import serve_ui

    with user_errors():
        serve_ui(host, port)


@main.command()
@click.argument("refs", nargs=-1)
@click.option("--model", default=None, help="registered model [default: the only eagle3-* model]")
@click.option("--baseline", default=None, help="version or @alias the deltas are against [default: @baseline]")
@click.option("--k", type=click.IntRange(min=1), default=None, help="chain length [default: every k evaluated]")
@click.option("--json", "output", flag_value="json", help="print JSON")
@click.option("--md", "output", flag_value="md", help="print a Markdown table")
def compare(refs: tuple[str, ...], model: str | None, baseline: str | None, k: int | None, output: str | None) -> None:
    """Compare drafter versions (number, @alias or run id; default @candidate) with the baseline: tau, acceptance,
    per-position rates and speedup, each with its delta and a bootstrap 95% CI over prompts."""
    from expman.registry.compare import compare as build_report
    from expman.registry.compare import render_json, render_markdown, render_text
    from expman.registry.reader import open_registry

    with user_errors():
        report = build_report(open_registry(), refs, model, baseline, k)
    render = {"json": render_json, "md": render_markdown}.get(output or "", render_text)
    click.echo(render(report))


@main.command()
@click.argument("model")
@click.argument("version")
@click.option("--alias", default="champion", show_default=True, help="alias to move: baseline, candidate, champion")
@click.option("--force", is_flag=True, help="promote although gates fail (needs --reason; recorded)")
@click.option("--reason", default=None, help="why; recorded on the version")
@click.option("--params", "params_file", default=None, help="params file [default: params.yaml if present]")
@click.option("--json", "as_json", is_flag=True, help="print every gate as JSON, also when refused")
def promote(
    model: str, version: str, alias: str, force: bool, reason: str | None, params_file: str | None, as_json: bool
) -> None:
    """Move ALIAS to MODEL's VERSION (number, @alias or run id) if it passes the promote gates."""
    from pathlib import Path

    from expman.params import EvaluateParams, PromoteParams, load_params
    from expman.registry.promote import PromotionRefused, render_gates, render_json, resolved_target
    from expman.registry.promote import promote as run_promotion
    from expman.registry.reader import open_registry

    with user_errors():
        if params_file is None and not Path("params.yaml").is_file():
            section = resolved_target(PromoteParams(), EvaluateParams())
        else:
            params = load_params(params_file or "params.yaml")
            section = resolved_target(params.promote, params.evaluate)
        try:
            promoted, k, gates = run_promotion(open_registry(), model, version, alias, section, force, reason)
        except PromotionRefused as refused:
            if as_json:
                click.echo(render_json(refused.version, alias, refused.k, refused.gates, section.target, False))
            raise
    if as_json:
        click.echo(render_json(promoted, alias, k, gates, section.target, True))
        return
    click.echo(render_gates(promoted, alias, k, gates, section.target))
    forced = " (forced: gates failed)" if not all(g.passed for g in gates) else ""
    click.echo(f"{promoted.name} v{promoted.version} is now @{alias}{forced}")


@main.command("import")
@click.argument("path", type=click.Path(path_type=str))
@click.option("--name", required=True, help="registered model name, e.g. eagle3-smollm2-135m-instruct")
@click.option("--alias", default=None, help="alias to set: baseline or candidate")
@click.option(
    "--layer-convention",
    type=click.Choice(["vllm", "sglang"]),
    default=None,
    help="aux-id convention of an EAGLE checkpoint that does not record it",
)
def import_(path: str, name: str, alias: str | None, layer_convention: str | None) -> None:
    """Validate a drafter folder (speculators or EAGLE format) and register it as a new version of NAME."""
    from pathlib import Path

    from expman.registry.versions import import_drafter

    with user_errors():
        version = import_drafter(Path(path), name, alias, layer_convention)
    click.echo(f"{name} v{version}" + (f" @{alias}" if alias else "") + f" (models:/{name}/{version})")


@main.command()
@click.argument("version")
@click.option("--model", default=None, help="registered model [default: the only eagle3-* model]")
@click.option("--format", "out_format", type=click.Choice(["speculators", "eagle"]), required=True)
@click.option("--out", required=True, help="new folder to write (refused if not empty)")
@click.option("--convention", type=click.Choice(["vllm", "sglang"]), default=None, help="eagle: aux-id convention")
def export(version: str, model: str | None, out_format: str, out: str, convention: str | None) -> None:
    """Write a registered VERSION (number, @alias or run id) as a speculators or EAGLE checkpoint folder."""
    from pathlib import Path

    from expman.registry.reader import open_registry
    from expman.registry.versions import export_version

    with user_errors():
        exported = export_version(open_registry(), model, version, out_format, Path(out), convention)
    click.echo(f"{exported.name} v{exported.version} -> {out} ({out_format})")


@main.command()
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True, help="rows of each list")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def runs(limit: int, as_json: bool) -> None:
    """Recent stage runs (stage, status, start, run id, key metrics) and registered versions with their aliases."""
    from expman.registry.runs import list_runs, render_runs

    with user_errors():
        listing = list_runs(limit)
    click.echo(json.dumps(listing, indent=2) if as_json else render_runs(listing))


@main.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="print JSON")
@click.pass_context
def features(context: click.Context, as_json: bool) -> None:
    """The feature store's sets: key, size, tokens, verifier, created, and the commits, branches and experiments
    whose extract manifest names them. Store: EXPMAN_FEATURE_STORE, else <project>/.expman/features."""
    if context.invoked_subcommand is not None:
        return
    from expman.data.feature_refs import list_sets, render_sets
    from expman.data.features import FeatureStore

    store = FeatureStore.default()
    listed = list_sets(store)
    click.echo(
        json.dumps({"store": str(store.root), "sets": listed}, indent=2) if as_json else render_sets(listed, store)
    )


@features.command("gc")
@click.option("--yes", is_flag=True, help="delete; without it, only say what would be deleted")
def features_gc(yes: bool) -> None:
    """Remove the sets that no commit, branch, experiment or the workspace references, and that no running stage
    holds. A dry run unless --yes."""
    from expman.data.feature_refs import collect_garbage

    lines = collect_garbage(delete=yes)
    click.echo("\n".join(lines) if lines else "nothing to remove: every set is referenced")
