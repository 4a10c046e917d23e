"""baseline: the drafter every candidate is measured against, registered with alias ``baseline``.

``baseline.source: train`` trains a small generic drafter from scratch on a share of the training samples (the
embedded default's stand-in for a public drafter such as AQ-MedAI's for Kimi-K2); any other value is a drafter
folder in speculators or EAGLE format, imported after validation and a check against the verifier. Either way
the canonical checkpoint lands in ``models/baseline`` (the train stage may finetune from it) and a version of
``eagle3-<verifier-slug>`` carries the alias ``baseline``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from expman.errors import ExpmanError
from expman.params import Params
from expman.paths import TrainPaths
from expman.provenance import atomic_write_json, read_manifest, sha256_file, upstream_entry
from expman.registry.tracking import StageRun, stage_run

__all__ = ["baseline"]


def _registrar(verifier_manifest: dict[str, Any], contract: dict[str, Any] | None, extra: dict[str, str]):
    """The finish step: register ``folder`` with alias ``baseline`` inside the stage's run, tagged with ``extra``
    besides its role and contract."""
    from expman.registry.versions import contract_tags, register_drafter, registered_model_name

    def finish(run: StageRun, folder: Path) -> dict[str, Any]:
        name = registered_model_name(verifier_manifest)
        tags = {"expman.role": "baseline", **(contract_tags(contract) if contract else {}), **extra}
        version = register_drafter(run, folder, name, "baseline", tags)
        return {"registered": {"name": name, "version": version, "alias": "baseline"}}  # the run's, not the data's

    return finish


def _import(params: Params, where: TrainPaths) -> dict[str, Any]:
    from expman.drafter.checkpoint import load_drafter, read_config, save_speculators
    from expman.drafter.objective import VerifierHead
    from expman.registry.versions import norm_tags

    section = params.baseline
    verifier_dir, out_dir = where.verifier, where.out
    verifier_manifest = read_manifest(verifier_dir / "manifest.json", "prepare")
    facts = verifier_manifest["verifier"]
    contract = read_manifest(where.extract / "manifest.json", "extract")["contract"]
    source = Path(section.source)
    drafter = load_drafter(source, section.layer_convention, embedding=VerifierHead.load(verifier_dir).embed)
    for key in ("hidden_size", "vocab_size"):
        if drafter.config.layer[key] != facts[key]:
            raise ExpmanError(
                f"baseline.source: {source}: {key} {drafter.config.layer[key]} != verifier's {facts[key]}"
            )
    notes = []
    if list(drafter.config.aux_layer_ids) != list(contract["aux_layers"]):
        notes.append(  # evaluable (the evaluator feeds its own ids), but train cannot finetune from it
            f"aux_layer_ids {list(drafter.config.aux_layer_ids)} differ from the features' {contract['aux_layers']}"
        )
    upstream = {"prepare": upstream_entry(verifier_dir / "manifest.json")}
    upstream["source"] = {"manifest": str(source), "manifest_sha256": sha256_file(next(source.glob("*.safetensors")))}
    with stage_run("baseline", section.model_dump(), upstream) as run:
        save_speculators(drafter, out_dir, str(verifier_dir), [facts["architecture"]], speculative_tokens=3)
        registered = _registrar(verifier_manifest, contract, norm_tags(read_config(source)))(run, out_dir)
        atomic_write_json(where.metrics, {"imported_from": str(source), "contract_notes": notes})
        return run.write_manifest(
            out_dir / "manifest.json",
            {"source": str(source), "contract_notes": notes, "contract": contract},
            registered,
        )


def baseline(params: Params, where: TrainPaths) -> dict[str, Any]:
    """Train or import the baseline into ``where.out`` and register it with alias ``baseline``."""
    section = params.baseline
    if section.source != "train":
        return _import(params, where)
    from expman.training.train import train

    verifier_manifest = read_manifest(where.verifier / "manifest.json", "prepare")
    contract = read_manifest(where.extract / "manifest.json", "extract")["contract"]
    return train(
        section.train,
        where,
        stage="baseline",
        sample_share=section.sample_fraction,
        finish=_registrar(verifier_manifest, contract, {}),
    )
