"""expman doctor: what would make the next stage fail or mislead, each finding with the command that fixes it.

Five checks, run from the project root. GPU: processes holding GPU memory; a leftover engine process (a vLLM
EngineCore whose stage died) can hold 81 GB until someone kills it. Disk: free space in the feature store against
the extract stage's storage estimate. Features: the set the extract manifest names is in the feature store (in a
teammate's clone after ``dvc pull`` it is not, unless they share the store). Contract: the capture contract of
the extract manifest against the verifier, the drafter checkpoints and the registered baseline / candidate /
champion. Versions: engine, libraries and CUDA. The doctor only reads: it kills and changes nothing, and imports
neither vllm nor mlflow.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from importlib import metadata, util
from pathlib import Path
from typing import Any

from expman import paths
from expman.data.extract import bytes_per_token
from expman.data.features import STORE_VARIABLE, FeatureStore
from expman.data.shards import disk_room, readable_size
from expman.errors import ExpmanError
from expman.params import Params, load_params, resolve_package_file

__all__ = [
    "Finding",
    "GpuProcess",
    "check_contract",
    "check_disk",
    "check_features",
    "check_gpu",
    "check_versions",
    "diagnose",
    "extract_estimate",
    "parse_compute_apps",
    "render_json",
    "render_text",
    "running_stage",
]

NVIDIA_SMI = ("nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader,nounits")
STAGE_SCRIPT = re.compile(r"(?:^|/)stages/([A-Za-z_]+)\.py$")  # how dvc.yaml runs a stage: python stages/<name>.py
TIGHT = 0.8  # warn when the extract would take more than this share of the free space
LIBRARIES = ("torch", "transformers", "safetensors", "mlflow", "dvc")
EXTRACT_MANIFEST = paths.EXTRACT / "manifest.json"
ALIAS_FIX = {"baseline": "dvc repro --force baseline", "candidate": "dvc repro --force register"}


@dataclass(frozen=True)
class Finding:
    """One line of the report: level ok, info, warning or error; ``fix`` is the command that resolves it."""

    check: str
    level: str
    message: str
    fix: str = ""


def _json(path: Path) -> Any:
    """A JSON file's content; None when it does not exist (that stage has not run)."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ExpmanError(f"{path}: not valid JSON") from None


# GPU: who holds GPU memory, and whether a running stage owns it.


@dataclass(frozen=True)
class GpuProcess:
    """One row of ``nvidia-smi --query-compute-apps``; ``used_mib`` is None where the driver does not say."""

    pid: int
    name: str
    used_mib: int | None


def parse_compute_apps(text: str) -> tuple[list[GpuProcess], list[str]]:
    """Rows of nvidia-smi's ``pid, process_name, used_memory`` CSV (no header, no units), and the lines that are
    not such rows. The name may hold commas, so pid is the first field and memory the last; memory may read
    ``[N/A]`` (MIG, some containers). Lines without a comma (``No running processes found``) are notes."""
    processes, unparsed = [], []
    for line in map(str.strip, text.splitlines()):
        if "," not in line:
            continue
        pid, _, rest = line.partition(",")
        name, comma, memory = rest.rpartition(",")
        if not comma or not pid.strip().isdigit():
            unparsed.append(line)
            continue
        memory = memory.strip()
        processes.append(GpuProcess(int(pid), name.strip(), int(memory) if memory.isdigit() else None))
    return processes, unparsed


def _argv(pid: int) -> list[str]:
    """A process's command line from /proc (empty when it is gone or not visible)."""
    try:
        return [a for a in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0") if a]
    except OSError:
        return []


def running_stage(pid: int) -> str | None:
    """The stage whose script (``stages/<name>.py``) ``pid`` or one of its ancestors runs, else None.

    Ancestors count because engines run in child processes (vLLM's EngineCore); the orphan of a dead stage has
    been re-parented to init and so belongs to no stage."""
    seen = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        for arg in _argv(pid):
            if found := STAGE_SCRIPT.search(arg):
                return found.group(1)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        pid = int(stat.rpartition(")")[2].split()[1])  # "pid (comm) state ppid ...", comm may hold spaces
    return None


def _gpu_finding(process: GpuProcess) -> Finding:
    """Whose the process is: a running stage's (fine), another user's (theirs to stop), or a leftover of ours."""
    held = "an unknown amount of" if process.used_mib is None else f"{process.used_mib:,} MiB of"
    what = f"pid {process.pid} ({process.name}) holds {held} GPU memory"
    stage = running_stage(process.pid)
    if stage is not None:
        return Finding("gpu", "info", f"{what} for the running stage {stage}")
    try:
        owner = Path(f"/proc/{process.pid}").stat().st_uid
    except OSError:
        where = "it is not in this machine's process table (another container?): kill it where it runs"
        return Finding("gpu", "warning", f"{what}; {where}", f"kill {process.pid}")
    command = " ".join(_argv(process.pid))
    command = command if len(command) <= 100 else command[:97] + "..."
    if owner != os.getuid():
        return Finding("gpu", "warning", f"{what} for user id {owner}, not you: ask them ({command})")
    return Finding(
        "gpu", "error", f"{what} and belongs to no running stage: a leftover? ({command})", f"kill {process.pid}"
    )


def check_gpu() -> list[Finding]:
    """Every process holding GPU memory, from nvidia-smi: a running stage's (fine) or a leftover (``kill <pid>``)."""
    query = " ".join(NVIDIA_SMI)
    if shutil.which(NVIDIA_SMI[0]) is None:
        return [Finding("gpu", "ok", "no GPU: nvidia-smi not found")]
    try:
        result = subprocess.run(list(NVIDIA_SMI), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return [Finding("gpu", "warning", f"nvidia-smi did not answer: {err}", query)]
    if result.returncode != 0:
        reason = (result.stderr or result.stdout or f"exit code {result.returncode}").strip().splitlines()[0]
        return [Finding("gpu", "warning", f"nvidia-smi failed: {reason}", query)]
    processes, unparsed = parse_compute_apps(result.stdout)
    findings = [Finding("gpu", "warning", f"nvidia-smi row not understood: {line!r}", query) for line in unparsed]
    if not processes and not unparsed:
        findings.append(Finding("gpu", "ok", "no process holds GPU memory"))
    return findings + [_gpu_finding(process) for process in processes]


# Disk: the extract stage's storage estimate against the free space where its shards go.


@dataclass(frozen=True)
class Estimate:
    """What extract will store: ``tokens`` × ``bytes_per_token``; ``basis`` says where the numbers come from."""

    tokens: int
    bytes_per_token: int
    basis: str

    @property
    def total(self) -> int:
        return self.tokens * self.bytes_per_token


def _hidden_size(params: Params) -> tuple[int, str]:
    """The verifier's hidden size and the file it was read from: the prepare manifest, else the source."""
    prepared = _json(paths.VERIFIER / "manifest.json")
    if prepared is not None:
        return int(prepared["verifier"]["hidden_size"]), str(paths.VERIFIER / "manifest.json")
    source = params.prepare.source
    path = resolve_package_file(source) if source.startswith("package:") else Path(source)
    if path.is_dir():
        config = _json(path / "config.json")
        return int(config.get("text_config", config)["hidden_size"]), str(path / "config.json")
    from gguf import GGUFReader

    reader = GGUFReader(path)
    architecture = reader.get_field("general.architecture").contents()
    return int(reader.get_field(f"{architecture}.embedding_length").contents()), str(path)


def _token_count(params: Params) -> tuple[int, str]:
    """Tokens extract will capture: generate's counts when it has run, else samples × extract.max_seq_len."""
    section = params.extract
    generated = _json(paths.GENERATED / "manifest.json")
    split = (generated or {}).get("splits", {}).get(section.split)
    if split:
        tokens = min(split["prompt_tokens"] + split["response_tokens"], split["records"] * section.max_seq_len)
        return tokens, str(paths.GENERATED / "manifest.json")
    samples = 0
    for spec in params.generate.datasets:
        if spec.split == section.split:
            with open(spec.path, encoding="utf-8") as handle:
                records = sum(1 for line in handle if line.strip())
            samples += min(records, spec.max_samples or records)
    return samples * section.max_seq_len, f"{samples} samples × extract.max_seq_len, an upper bound before generate"


def extract_estimate(params: Params) -> Estimate:
    """Bytes extract will write: per token the aux states [3H] and the final state [H] in bf16, ids and mask."""
    hidden, hidden_from = _hidden_size(params)
    tokens, tokens_from = _token_count(params)
    basis = f"hidden size {hidden} from {hidden_from}; tokens from {tokens_from}"
    return Estimate(tokens, bytes_per_token(hidden), basis)


def _planned_key(params: Params) -> str | None:
    """The key extract would publish for the workspace's params and inputs; None before generate has run."""
    from expman.data.extract import planned_key

    try:
        return planned_key(params, paths.ExtractPaths.default())
    except (ExpmanError, OSError, KeyError, TypeError, ValueError):
        return None


def check_disk(params: Params) -> list[Finding]:
    """The extract estimate against the free space of the disk that holds the feature store, less what is there
    already: nothing when the params' feature set is published, the shards a killed extract left in its partial
    folder otherwise (extract resumes them)."""
    if params.train.features == "online":
        return [Finding("disk", "ok", "train.features: online: extract stores no features")]
    try:
        estimate = extract_estimate(params)
    except (ExpmanError, OSError, KeyError, TypeError, ValueError) as err:
        return [Finding("disk", "warning", f"no extract storage estimate: {err}", "dvc repro prepare")]
    store = FeatureStore.default()
    key = _planned_key(params)
    if key is not None and store.published(key) is not None:
        return [Finding("disk", "ok", f"features {key} of these params are in the feature store {store.root} already")]
    free, written = disk_room(store.partial_folder(key) if key else store.root)
    needed = max(estimate.total - written, 0)
    resumed = f", {readable_size(written)} of it written already by an interrupted extract" if written else ""
    message = (
        f"extract needs about {readable_size(estimate.total)} in the feature store {store.root} ({estimate.tokens:,} "
        f"tokens × {estimate.bytes_per_token:,} B; {estimate.basis}{resumed}); {readable_size(free)} free there"
    )
    fix = f"expman features gc --yes, or export {STORE_VARIABLE}=<a folder on a disk with {readable_size(needed)} free>"
    if needed > free:
        return [Finding("disk", "error", message, fix)]
    if needed > TIGHT * free:
        return [Finding("disk", "warning", message + " (tight)", fix)]
    return [Finding("disk", "ok", message)]


def check_features() -> list[Finding]:
    """The feature set the workspace's extract manifest names, in the feature store."""
    manifest = _json(EXTRACT_MANIFEST)
    key = ((manifest or {}).get("features") or {}).get("key") if isinstance(manifest, dict) else None
    if key is None:
        return []
    store = FeatureStore.default()
    if store.published(key) is None:
        message = (
            f"{EXTRACT_MANIFEST} names features {key} ({len(manifest.get('shards', []))} shards), which the feature "
            f"store {store.root} lacks: train cannot read them"
        )
        fix = f"export {STORE_VARIABLE}=<the store that has them>, or compute them here: dvc repro -f extract"
        return [Finding("features", "error", message, fix)]
    return [Finding("features", "ok", f"features {key} of {EXTRACT_MANIFEST} are in {store.root}")]


# Contract: the extract manifest's capture contract against everything that must agree with it.


def _differing(left: dict[str, Any], right: dict[str, Any]) -> list[str]:
    return sorted(k for k in left.keys() | right.keys() if left.get(k) != right.get(k))


def _checkpoint_differences(folder: Path, contract: dict[str, Any]) -> list[str]:
    """How a stage's drafter folder disagrees with ``contract``: its config.json (aux ids, hidden size, vocab)
    and the contract its manifest.json says it was trained on."""
    differences = []
    config = _json(folder / "config.json")
    if config is not None:
        where = folder / "config.json"
        if config.get("speculators_model_type") != "eagle3":
            return [f"{where} is not a speculators-format checkpoint"]
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        if ids != contract["aux_layers"]:
            differences.append(f"{where} eagle_aux_hidden_state_layer_ids {ids} != aux_layers {contract['aux_layers']}")
        layer = config.get("transformer_layer_config") or {}
        for key in ("hidden_size", "vocab_size"):
            if layer.get(key) != contract["verifier"][key]:
                differences.append(
                    f"{where} transformer_layer_config.{key} {layer.get(key)} != verifier {key} "
                    f"{contract['verifier'][key]}"
                )
    manifest = _json(folder / "manifest.json")
    if manifest is not None and manifest.get("contract") not in (None, contract):
        keys = ", ".join(_differing(manifest["contract"], contract))
        differences.append(f"{folder / 'manifest.json'} was trained on another contract ({keys} differ)")
    return differences


def _registry_findings(model: str, contract: dict[str, Any]) -> tuple[list[Finding], list[str]]:
    """The registered baseline, candidate and champion of ``model``: their ``expman.contract.*`` tags; and the
    versions read."""
    from expman.registry.reader import open_registry
    from expman.registry.versions import ALIASES

    try:
        reader = open_registry()
        versions = {alias: reader.alias(model, alias) for alias in ALIASES}
        records = {alias: reader.version(model, number) for alias, number in versions.items() if number is not None}
    except ExpmanError as err:
        return [Finding("contract", "info", f"registry not checked: {err}")], []
    findings, checked = [], []
    for alias, record in records.items():
        if record is None:
            continue
        name = f"{model} v{record.version} (@{alias})"
        checked.append(f"{model} v{record.version} @{alias}")
        tags = record.tags
        if "expman.contract.aux_layers" not in tags:
            findings.append(
                Finding("contract", "warning", f"{name}: no expman.contract.* tags; its contract is unknown")
            )
            continue
        stated = {
            "aux_layers": json.loads(tags["expman.contract.aux_layers"]),
            "final_state": tags.get("expman.contract.final_state", contract["final_state"]),
            "verifier weights_sha256": tags.get(
                "expman.contract.verifier.weights_sha256", contract["verifier"]["weights_sha256"]
            ),
        }
        expected = {
            "aux_layers": contract["aux_layers"],
            "final_state": contract["final_state"],
            "verifier weights_sha256": contract["verifier"]["weights_sha256"],
        }
        keys = _differing(stated, expected)
        if keys:
            message = f"{name}: its expman.contract tags differ from {EXTRACT_MANIFEST} in {', '.join(keys)}"
            if alias in ALIAS_FIX:
                findings.append(Finding("contract", "error", message, ALIAS_FIX[alias]))
            else:
                older = f"{message}: it was trained on other features than the current ones"
                findings.append(
                    Finding("contract", "warning", older, f"expman promote {model} @candidate --alias {alias}")
                )
    return findings, checked


def check_contract(model: str | None) -> list[Finding]:
    """The extract manifest's contract against the prepared verifier, the baseline and trained drafters, and the
    registry versions of ``model`` (None: registry not checked)."""
    contract = (_json(EXTRACT_MANIFEST) or {}).get("contract")
    if contract is None:
        return [Finding("contract", "ok", f"no {EXTRACT_MANIFEST} yet: nothing to check (dvc repro extract writes it)")]
    findings, checked = [], []
    prepared = _json(paths.VERIFIER / "manifest.json")
    if prepared is not None:
        checked.append(str(paths.VERIFIER / "manifest.json"))
    if prepared is not None and prepared.get("verifier") != contract["verifier"]:
        keys = ", ".join(_differing(prepared.get("verifier") or {}, contract["verifier"]))
        message = f"{EXTRACT_MANIFEST} was extracted from another verifier than {paths.VERIFIER / 'manifest.json'}"
        findings.append(Finding("contract", "error", f"{message} ({keys} differ)", "dvc repro extract"))
    for stage, folder in (("baseline", paths.BASELINE), ("train", paths.DRAFTER)):
        if folder.is_dir():
            checked.append(str(folder))
        differences = _checkpoint_differences(folder, contract)
        if differences:
            message = f"{folder} does not match {EXTRACT_MANIFEST}: {'; '.join(differences)}"
            findings.append(Finding("contract", "error", message, f"dvc repro {stage}"))
    if model is not None:
        registry, versions = _registry_findings(model, contract)
        findings += registry
        checked += versions
    if not any(f.level in ("warning", "error") for f in findings):
        verifier = contract["verifier"]
        summary = (
            f"{EXTRACT_MANIFEST}: aux layers {contract['aux_layers']}, {contract['final_state']}, hidden size "
            f"{verifier['hidden_size']}, vocab {verifier['vocab_size']}; "
            + (f"agrees with {', '.join(checked)}" if checked else "nothing else to compare it with yet")
        )
        findings.insert(0, Finding("contract", "ok", summary))
    return findings


# Versions: the engine, the libraries that change results, CUDA.


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def check_versions(params: Params | None) -> list[Finding]:
    """Library and engine versions (vLLM from its distribution's metadata: importing it costs seconds) and CUDA;
    errors where params ask for an engine or a device that is not there."""
    import torch

    libraries = [f"{name} {_installed(name) or 'missing'}" for name in LIBRARIES]
    engines = metadata.packages_distributions().get("vllm", []) if util.find_spec("vllm") else []
    engine = ", ".join(f"{d} {_installed(d)}" for d in engines) if engines else "vllm not installed"
    cuda = torch.cuda.is_available()
    if cuda:
        devices = f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s)"
    else:
        devices = f"no CUDA device (torch built for CUDA {torch.version.cuda})" if torch.version.cuda else "CPU torch"
    python = sys.version.split()[0]
    findings = [Finding("versions", "info", f"python {python}, {', '.join(libraries)}; engine: {engine}; {devices}")]
    if params is None:
        return findings
    wanted = [
        key
        for key, on in (("generate.backend", params.generate.backend), ("benchmark.engine", params.benchmark.engine))
        if on == "vllm"
    ]
    if wanted and not engines:
        install = "pip install vllm" if cuda else "pip install -e '.[engine]'"
        findings.append(Finding("versions", "error", f"{' and '.join(wanted)}: vllm, which is not installed", install))
    devices_asked = {
        "generate.device": params.generate.device,
        "extract.device": params.extract.device,
        "baseline.train.device": params.baseline.train.device,
        "train.device": params.train.device,
        "evaluate.device": params.evaluate.device,
        "benchmark.device": params.benchmark.device,
    }
    on_cuda = [key for key, device in devices_asked.items() if device == "cuda"]
    if on_cuda and not cuda:
        fix = "dvc exp run " + " ".join(f"-S {key}=auto" for key in on_cuda)
        findings.append(Finding("versions", "error", f"{', '.join(on_cuda)}: cuda, but torch sees no CUDA device", fix))
    return findings


def _model_name(params: Params | None) -> str | None:
    """The registered model the project writes: register.model_name, else eagle3-<slug of the verifier source>."""
    from expman.registry.versions import MODEL_PREFIX, verifier_slug

    if params is not None and params.register_.model_name != "auto":
        return params.register_.model_name
    source = (
        params.prepare.source if params is not None else (_json(paths.VERIFIER / "manifest.json") or {}).get("source")
    )
    try:
        return MODEL_PREFIX + verifier_slug(source) if source else None
    except ExpmanError:
        return None


def diagnose(params_file: Path) -> list[Finding]:
    """Every check, in order: GPU, params, disk, features, contract, versions. A check that cannot run is a finding
    too."""
    findings = check_gpu()
    try:
        params = load_params(params_file)
    except ExpmanError as err:
        params = None
        findings.append(Finding("params", "error", str(err), f"expman params check --params {params_file}"))
    if params is not None:
        findings += check_disk(params)
    findings += check_features()
    try:
        findings += check_contract(_model_name(params))
    except (ExpmanError, KeyError, TypeError, AttributeError) as err:  # a manifest that is not as stages write it
        reason = str(err) if isinstance(err, ExpmanError) else f"malformed manifest ({type(err).__name__}: {err})"
        findings.append(Finding("contract", "error", f"contract not checked: {reason}", "dvc repro"))
    findings += check_versions(params)
    return findings


def render_text(findings: list[Finding]) -> str:
    """One line per finding (level, check, message), its fix on the next line, and a count at the end."""
    lines = []
    for finding in findings:
        lines.append(f"{finding.level:<8}{finding.check:<10}{finding.message}")
        if finding.fix:
            lines.append(f"{'':<18}fix: {finding.fix}")
    errors = sum(f.level == "error" for f in findings)
    warnings = sum(f.level == "warning" for f in findings)
    lines.append(f"{errors} error(s), {warnings} warning(s)" if errors or warnings else "no problems found")
    return "\n".join(lines)


def render_json(findings: list[Finding]) -> str:
    errors = sum(f.level == "error" for f in findings)
    report = {"ok": errors == 0, "errors": errors, "findings": [asdict(f) for f in findings]}
    return json.dumps(report, indent=2)
