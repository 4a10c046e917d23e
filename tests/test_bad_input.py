"""The bad-input matrix: each bad params value, prompt file, verifier, shard, checkpoint, registry reference or CLI
argument is refused with a non-zero exit code and one line on stderr naming the culprit (the key, file or tensor),
no traceback, and nothing written or removed (no output, no temp file, no MLflow run).

Stages run through their click entry points (``stages/<name>.py``) in-process, and bad params files also as the
``python stages/prepare.py`` a user types; the ``expman`` CLI runs under click's CliRunner. The data half of the
graph is built once on the tiny verifier and copied for each case that needs it.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest
import torch
import yaml
from click.testing import CliRunner, Result
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from expman.cli import main as expman
from expman.data.features import FeatureStore, feature_folder
from tests.conftest import tiny_params, write_prompts
from tests.registry_fixtures import _empty_store, tiny_checkpoint, use_store
from tests.test_params import DELETE, _set
from tests.test_pipeline import run_until

REPO = Path(__file__).resolve().parents[1]
MODEL = "eagle3-tiny"


@functools.cache
def _stage(name: str) -> click.Command:
    """The click command of ``stages/<name>.py`` (the stages folder is not a package)."""
    spec = importlib.util.spec_from_file_location(f"stage_{name}", REPO / "stages" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file (size, mtime) and folder under ``root``: a refused command must leave it exactly as it was."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else (-1, 0)
        for p in root.rglob("*")
    }


def _one_line(code: int, stdout: str, stderr: str, culprit: str) -> None:
    """A refusal: non-zero exit, nothing on stdout, one ``error:`` line on stderr that holds ``culprit``."""
    assert code != 0
    assert "Traceback" not in stdout + stderr, stderr
    assert stdout == "", stdout
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert culprit in lines[0], lines[0]


def _refused(command: click.Command, args: list[str], culprit: str, *roots: Path, env: dict | None = None) -> str:
    """Invoke ``command``; it must fail with one ``error:`` line holding ``culprit`` and leave ``roots`` (default: the
    cwd) as they were. Returns that line."""
    roots = roots or (Path.cwd(),)
    before = [_tree(root) for root in roots]
    result = CliRunner().invoke(command, args, env=env)
    assert isinstance(result.exception, SystemExit), result.exception  # anything else is an uncaught traceback
    _one_line(result.exit_code, result.stdout, result.stderr, culprit)
    assert [_tree(root) for root in roots] == before
    return result.stderr.strip()


def _usage_error(result: Result, culprit: str) -> None:
    """click's own usage message (Usage, hint, one Error line naming the option or argument), no traceback."""
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output
    assert result.stderr.startswith("Usage: ") and result.stdout == ""
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and culprit in errors[0], result.stderr


def _write_params(root: Path, key: str, value: object, name: str = "params.yaml") -> None:
    data = yaml.safe_load((root / "params.yaml").read_text())
    _set(data, key, value)
    (root / name).write_text(yaml.safe_dump(data, sort_keys=False))


# --- params.yaml: each stage validates the whole file before it reads anything else ---------------------------

PARAMS = [
    ("train", "train.epochs", True, "train.epochs: true is a boolean; this key is not a flag"),
    ("evaluate", "evaluate.max_new_tokens", [64], "evaluate.max_new_tokens: Input should be a valid integer"),
    ("train", "train", 5, 'section "train" must be a mapping of keys (got 5)'),
    ("train", "train.val_fraction", 0.7, "train.val_fraction: Input should be less than 0.5 (got 0.7)"),
    ("evaluate", "evaluate.ks", [1, 17], "evaluate.ks[1]: Input should be less than or equal to 16 (got 17)"),
    ("benchmark", "benchmark.tau_ratio", 1.5, "benchmark.tau_ratio: Input should be less than or equal to 1"),
    ("train", "train.lr", float("inf"), "train.lr: Input should be a finite number (got inf)"),
    ("evaluate", "evaluate.ks", [3, 3], "evaluate.ks: each k at most once"),
    ("baseline", "baseline.train.lrr", 1e-3, "baseline.train.lrr: unknown key"),
    ("generate", "generate.datasets.1.splt", "heldout", "generate.datasets[1].splt: unknown key"),
    ("extract", "extract", DELETE, 'section "extract" is missing'),
    ("generate", "generate.datasets.0.path", DELETE, "generate.datasets[0].path: required key is missing"),
    ("register", "register.model_name", "bad name!", "register.model_name: String should match pattern"),
    ("baseline", "baseline.source", "no-such-drafter", "baseline.source: neither 'train' nor a drafter checkpoint"),
    ("prepare", "prepare.source", "prompts", "prepare.source: prompts is a folder without config.json"),
    (
        "prepare",
        "prepare.source",
        "tiny-verifier/model.safetensors",
        "prepare.source: tiny-verifier/model.safetensors is neither an HF model folder nor a .gguf file",
    ),
    ("generate", "generate.datasets.0.path", "prompts", "generate.datasets[0].path: file not found: prompts"),
]


@pytest.mark.parametrize(
    ("stage", "key", "value", "culprit"),
    PARAMS,
    ids=[f"{k}={'(deleted)' if v is DELETE else repr(v)}"[:40] for _, k, v, _ in PARAMS],
)
def test_bad_params_value(project: Path, stage: str, key: str, value: object, culprit: str) -> None:
    _write_params(project, key, value, "bad.yaml")
    _refused(_stage(stage), ["--params", "bad.yaml"], f"error: bad.yaml: {culprit}")


def _script(root: Path, stage: str, *args: str) -> subprocess.CompletedProcess:
    """``python stages/<stage>.py ARGS`` in ``root``, as a user or DVC runs it."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    command = [sys.executable, str(REPO / "stages" / f"{stage}.py"), *args]
    return subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("content", "culprit"),
    [
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "bad.yaml: not valid YAML"),  # not YAML at all
        (b"prepare:\n\tsource: tiny-verifier\n", "bad.yaml: not valid YAML at line 2"),  # tab indentation
        (b"just one string\n", "bad.yaml: expected a mapping of stage sections at the top level"),
    ],
    ids=["binary", "tabs", "scalar"],
)
def test_unreadable_params_file_as_a_user_runs_it(project: Path, content: bytes, culprit: str) -> None:
    (project / "bad.yaml").write_bytes(content)
    before = _tree(project)
    result = _script(project, "prepare", "--params", "bad.yaml")
    _one_line(result.returncode, result.stdout, result.stderr, culprit)
    assert _tree(project) == before


def test_params_path_is_a_folder(project: Path) -> None:
    result = _script(project, "prepare", "--params", "prompts")
    _one_line(result.returncode, result.stdout, result.stderr, "error: prompts: a folder, not a params file")


def test_bad_promote_params(project: Path) -> None:
    _write_params(project, "promote", {"min_speedup": 0})
    _refused(expman, ["promote", MODEL, "1"], "error: params.yaml: promote.min_speedup: Input should be greater than 0")


# --- the graph's own inputs: built once to vocab on the tiny verifier, copied per case -------------------------


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, tiny_verifier_source: Path) -> Path:
    """prepare → generate → extract → vocab on 4 train and 2 held-out prompts (2 extract shards)."""
    root = tmp_path_factory.mktemp("built")
    shutil.copytree(tiny_verifier_source, root / "tiny-verifier")
    (root / "prompts").mkdir()
    write_prompts(root / "prompts", "train", 4)
    write_prompts(root / "prompts", "heldout", 2)
    params = tiny_params("tiny-verifier")
    params["generate"]["max_new_tokens"] = 6
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    shutil.copyfile(_empty_store(), root / "mlflow.db")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "DVC_EXP_NAME"):
            patch.delenv(name, raising=False)
        patch.setenv("GIT_CEILING_DIRECTORIES", str(root.parent))
        run_until("vocab")
    return root


@pytest.fixture
def staged(built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the built project as the cwd."""
    root = tmp_path / "project"
    shutil.copytree(built, root)
    monkeypatch.chdir(root)
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "DVC_EXP_NAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    return root


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


FIRST_ID = json.loads(_lines(REPO / "data/prompts/train.jsonl")[0])["id"]


PROMPTS = [
    (
        "invalid_json",
        lambda p: (p / "train.jsonl").write_text("\n".join([*_lines(p / "train.jsonl")[:2], '{"prompt": "x",']) + "\n"),
        "prompts/train.jsonl:3: invalid JSON",
    ),
    ("empty", lambda p: (p / "heldout.jsonl").write_bytes(b""), "prompts/heldout.jsonl: no records"),
    (
        "missing_field",
        lambda p: (p / "train.jsonl").write_text(
            _lines(p / "train.jsonl")[0] + '\n{"conversations": [{"from": "human"}]}\n'
        ),
        'prompts/train.jsonl:2: conversations[0] needs a string "value"',
    ),
    (
        "not_utf8",
        lambda p: (p / "train.jsonl").write_bytes('{"prompt": "caf\u00e9 au lait?"}\n'.encode("latin-1")),
        "prompts/train.jsonl: not UTF-8 (byte 15)",
    ),
    (
        "duplicate_id",
        lambda p: (p / "heldout.jsonl").write_text(_lines(p / "train.jsonl")[0] + "\n"),
        f"prompts/heldout.jsonl: id {FIRST_ID!r} also appears in prompts/train.jsonl",
    ),
    (
        "wrong_type",
        lambda p: (p / "train.jsonl").write_text('{"messages": "What is 2 + 2?"}\n'),
        'prompts/train.jsonl:1: "messages" must be a non-empty list',
    ),
]


@pytest.mark.parametrize(("damage", "culprit"), [c[1:] for c in PROMPTS], ids=[c[0] for c in PROMPTS])
def test_bad_prompt_file(staged: Path, damage, culprit: str) -> None:
    damage(staged / "prompts")
    _refused(_stage("generate"), [], culprit)


VERIFIERS = [
    ("config_not_json", lambda v: (v / "config.json").write_text("{not json"), "config.json' is not a valid JSON"),
    ("no_weights", lambda v: (v / "model.safetensors").unlink(), "no file named model.safetensors"),
    (
        "truncated_safetensors",
        lambda v: (v / "model.safetensors").write_bytes((v / "model.safetensors").read_bytes()[:4000]),
        "SafetensorError",
    ),
]


@pytest.mark.parametrize(("damage", "culprit"), [c[1:] for c in VERIFIERS], ids=[c[0] for c in VERIFIERS])
def test_unloadable_verifier_folder(project: Path, damage, culprit: str) -> None:
    damage(project / "tiny-verifier")
    line = _refused(_stage("prepare"), [], f"error: {project / 'tiny-verifier'}: cannot load the verifier: ")
    assert culprit in line


@pytest.mark.parametrize(
    "content",
    [b"GGUF\x03\x00\x00\x00" + b"\xff" * 64, b"this is not a gguf file\n", b""],
    ids=["garbage_header", "not_gguf", "empty"],
)
def test_corrupted_gguf(project: Path, content: bytes) -> None:
    (project / "bad.gguf").write_bytes(content)
    _write_params(project, "prepare.source", "bad.gguf")
    _refused(_stage("prepare"), [], f"error: {project / 'bad.gguf'}: cannot load the verifier: ")


def _shard(root: Path, index: int) -> Path:
    """The extract shard the manifest lists at ``index``, in the project's feature store."""
    manifest = json.loads((root / "data/extract/manifest.json").read_text())
    folder = feature_folder(manifest)
    assert folder.is_relative_to(root / ".expman/features")  # the staged copy's own store, not the built one's
    return folder / manifest["shards"][index]["path"]


def test_garbage_extract_shard(staged: Path) -> None:
    shard = _shard(staged, 0)
    data = bytearray(shard.read_bytes())
    data[:16] = b"\xff" * 16  # same size, unreadable header
    shard.write_bytes(bytes(data))
    _refused(_stage("train"), [], f"{shard}: not the shard the manifest lists")


def test_same_size_shard_from_another_run(staged: Path) -> None:
    shard = _shard(staged, 0)
    with safe_open(str(shard), "pt") as handle:
        metadata = json.loads(handle.metadata()["expman"])
    tensors = load_file(str(shard))
    tensors["aux_hidden_states"] = tensors["aux_hidden_states"].roll(1, dims=1)  # other aux layers, same shapes
    metadata["key"] = "0" * len(metadata["key"])
    size = shard.stat().st_size
    save_file(tensors, str(shard), metadata={"expman": json.dumps(metadata)})
    assert shard.stat().st_size == size  # only the plan key can tell it apart before a full checksum
    _refused(_stage("train"), [], f"{shard}: not the shard the manifest lists")


def test_shard_swapped_with_another(staged: Path) -> None:
    shutil.copyfile(_shard(staged, 1), _shard(staged, 0))
    _refused(_stage("baseline"), [], f"{_shard(staged, 0)}: not the shard the manifest lists")


def test_shards_that_cannot_fit_the_disk(staged: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """extract refuses before the verifier loads when its shards cannot fit the disk of the feature store (the gpu
    preset writes 37.7 GB; a run that ran out of room midway would have spent its GPU time for nothing), and a
    resumed extract counts the shards it already wrote as room."""
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=1000))
    result = CliRunner().invoke(_stage("extract"), [])  # the set is published: nothing more to write
    assert result.exit_code == 0, result.output
    store = FeatureStore.default()
    key = json.loads((staged / "data/extract/manifest.json").read_text())["features"]["key"]
    store.folder(key).rename(store.partial_folder(key))  # every shard written, the set not yet published: a kill
    shutil.rmtree(staged / "data/extract")
    result = CliRunner().invoke(_stage("extract"), [])  # the shards already written count as room
    assert result.exit_code == 0, result.output
    assert store.published(key) is not None and not store.partial_folder(key).exists()
    shutil.rmtree(store.folder(key))
    shutil.rmtree(staged / "data/extract")
    line = _refused(
        _stage("extract"),
        [],
        f"error: EXPMAN_FEATURE_STORE: the feature store {store.root} has 1.0 kB free, the shards need",
    )
    assert line.endswith("point EXPMAN_FEATURE_STORE at a larger disk, or free the store: expman features gc"), line


def test_missing_extract_shard(staged: Path) -> None:
    shard = _shard(staged, 1)
    shard.unlink()
    culprit = f"{shard}: shard listed in the manifest is missing"
    _refused(_stage("train"), [], culprit)


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_vocab_of_another_verifier(staged: Path) -> None:
    _edit_json(staged / "data/vocab/manifest.json", lambda m: m["verifier"].update(weights_sha256="0" * 64))
    _refused(_stage("train"), [], "data/vocab/manifest.json: the vocab was built for another verifier")


def test_responses_of_another_verifier(staged: Path) -> None:
    _edit_json(staged / "data/generated/manifest.json", lambda m: m["verifier"].update(tokenizer_sha256="0" * 64))
    _refused(_stage("extract"), [], "data/generated/manifest.json: responses come from another verifier")


def test_tampered_response_shard(staged: Path) -> None:
    shard = staged / "data/generated/train/shard-00000.jsonl"
    shard.write_text(shard.read_text().replace('"ok": true', '"ok": false', 1))
    _refused(_stage("vocab"), [], "data/generated/train/shard-00000.jsonl: checksum mismatch")


def test_manifest_not_an_object(staged: Path) -> None:
    (staged / "data/extract/manifest.json").write_text("[]\n")
    _refused(_stage("train"), [], "data/extract/manifest.json: expected a 'extract' manifest")


def test_manifest_of_another_stage(staged: Path) -> None:
    shutil.copyfile(staged / "data/vocab/manifest.json", staged / "data/extract/manifest.json")
    _refused(_stage("baseline"), [], "data/extract/manifest.json: expected a 'extract' manifest, found stage 'vocab'")


def test_torn_prepared_verifier(staged: Path) -> None:
    weights = staged / "models/verifier/model.safetensors"
    weights.write_bytes(weights.read_bytes()[:3000])
    _refused(_stage("train"), [], "models/verifier/model.safetensors: unreadable safetensors")


# --- incompatible checkpoints: a drafter for another verifier (hidden 16, vocab 50 against 32 and 400) --------


def _foreign_eagle(folder: Path) -> Path:
    """An EAGLE-format drafter (no embedding) for another verifier."""
    from expman.drafter.checkpoint import export_eagle
    from tests.test_checkpoint import _vocab
    from tests.test_drafter import _drafter

    model = _drafter()
    _vocab(model)
    export_eagle(model, folder, "vllm")
    return folder


def test_finetune_from_a_drafter_with_another_hidden_size(staged: Path) -> None:
    tiny_checkpoint(staged / "other-drafter")
    _write_params(staged, "train.finetune_from", "other-drafter")
    _refused(_stage("train"), [], "train.finetune_from: other-drafter is incompatible: hidden_size 16 != 32")


def test_finetune_from_a_file(staged: Path) -> None:
    _write_params(staged, "train.finetune_from", "params.yaml")
    _refused(_stage("train"), [], "train.finetune_from: params.yaml: not a drafter checkpoint folder (no config.json)")


def test_baseline_with_another_hidden_size(staged: Path) -> None:
    tiny_checkpoint(staged / "other-drafter")
    _write_params(staged, "baseline.source", "other-drafter")
    _refused(_stage("baseline"), [], "baseline.source: other-drafter: hidden_size 16 != verifier's 32")


def test_eagle_baseline_for_another_verifier(staged: Path) -> None:
    _foreign_eagle(staged / "aq-drafter")
    _write_params(staged, "baseline.source", "aq-drafter")
    _refused(_stage("baseline"), [], "aq-drafter: tensor embed_tokens.weight must be [50, 16], the verifier's is [")


# --- the registry: one store with eagle3-tiny v1 (@baseline), shared read-only by every case -------------------


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("store")
    with pytest.MonkeyPatch.context() as patch:
        use_store(root, patch)
        from expman.registry.versions import import_drafter

        import_drafter(tiny_checkpoint(root.parent / "store-source"), MODEL, "baseline", None)
    return root


@pytest.fixture
def store(shared_store: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(shared_store)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{shared_store / 'mlflow.db'}")
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(shared_store.parent))
    return shared_store


def _damaged_checkpoint(folder: Path, config=None, text=None, tensors=None, weights=None) -> Path:
    """The tiny drafter with its config.json (edited or replaced by ``text``), tensors or weight bytes changed."""
    tiny_checkpoint(folder)
    if config is not None:
        _edit_json(folder / "config.json", config)
    if text is not None:
        (folder / "config.json").write_text(text)
    if tensors is not None:
        state = load_file(str(folder / "model.safetensors"))
        tensors(state)
        save_file(state, str(folder / "model.safetensors"))
    if weights is not None:
        path = folder / "model.safetensors"
        path.write_bytes(weights(path.read_bytes()))
    return folder


IMPORTS = [
    ("wrong_shape", {"tensors": lambda t: t.update({"fc.weight": torch.zeros(16, 40)})}, "tensor fc.weight has shape"),
    ("missing_tensor", {"tensors": lambda t: t.pop("lm_head.weight")}, "tensor lm_head.weight is missing"),
    ("truncated", {"weights": lambda b: b[: len(b) // 2]}, "model.safetensors: unreadable safetensors"),
    ("garbage_header", {"weights": lambda b: b[:8] + b"\xff" * 32 + b[40:]}, "model.safetensors: unreadable"),
    ("config_not_object", {"text": "[1, 2, 3]"}, "config.json: expected a JSON object"),
    (
        "size_not_a_number",
        {"config": lambda c: c["transformer_layer_config"].update(hidden_size="16")},
        "config.json: hidden_size must be a positive integer, got '16'",
    ),
    (
        "aux_ids_not_numbers",
        {"config": lambda c: c.update(eagle_aux_hidden_state_layer_ids=["2", "4", "5"])},
        "config.json: eagle_aux_hidden_state_layer_ids must list 3 layer ids",
    ),
]


@pytest.mark.parametrize(("damage", "culprit"), [c[1:] for c in IMPORTS], ids=[c[0] for c in IMPORTS])
def test_import_of_a_bad_checkpoint(store: Path, tmp_path: Path, damage: dict, culprit: str) -> None:
    folder = _damaged_checkpoint(tmp_path / "drafter", **damage)
    line = _refused(expman, ["import", str(folder), "--name", MODEL], culprit, store, tmp_path)
    assert line.startswith(f"error: {folder}")


def test_import_of_a_file(store: Path, tmp_path: Path) -> None:
    (tmp_path / "drafter.safetensors").write_bytes(b"not a folder")
    culprit = f"{tmp_path / 'drafter.safetensors'}: no config.json"
    _refused(expman, ["import", str(tmp_path / "drafter.safetensors"), "--name", MODEL], culprit, store, tmp_path)


REFERENCES = [
    (["compare", "@nope"], f"{MODEL}: no alias @nope"),
    (["compare", "1", "--baseline", "99"], f"{MODEL}: no version 99"),
    (["promote", "eagle3-nope", "1"], "model 'eagle3-nope' is not registered"),
    (["promote", MODEL, "v1"], "'v1': expected a version number, an @alias or a run id"),
    (["export", "3", "--format", "speculators", "--out", "out"], f"{MODEL}: no version 3"),
]


@pytest.mark.parametrize(("args", "culprit"), REFERENCES, ids=[" ".join(a[:2]) for a, _ in REFERENCES])
def test_unknown_registry_reference(store: Path, args: list[str], culprit: str) -> None:
    _refused(expman, args, culprit, store)


def test_export_into_a_file(store: Path, tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "afile/drafter"
    culprit = f"{out}: {tmp_path / 'afile'} is a file, not a folder"
    _refused(expman, ["export", "1", "--format", "eagle", "--out", str(out)], culprit, store, tmp_path)


def test_unsupported_tracking_store(store: Path) -> None:
    env = {"MLFLOW_TRACKING_URI": f"file://{store / 'mlruns'}"}
    _refused(expman, ["compare"], "MLFLOW_TRACKING_URI: a file store is not supported", store, env=env)


def test_no_tracking_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    _refused(expman, ["runs"], f"{tmp_path / 'mlflow.db'}: no MLflow store")


# --- click usage errors: click's message, exit code 2, no traceback --------------------------------------------

USAGE = [
    (["export", "1", "--format", "onnx", "--out", "o"], "'--format'"),
    (["compare", "--k", "0"], "'--k'"),
    (["import", "drafter"], "'--name'"),
    (["promote", MODEL], "'VERSION'"),
    (["frobnicate"], "'frobnicate'"),
    (["runs", "--limit", "many"], "'--limit'"),
    (["import", "drafter", "--name", MODEL, "--layer-convention", "specforge"], "'--layer-convention'"),
]


@pytest.mark.parametrize(("args", "culprit"), USAGE, ids=[c.strip("'") for _, c in USAGE])
def test_cli_usage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], culprit: str) -> None:
    monkeypatch.chdir(tmp_path)
    _usage_error(CliRunner().invoke(expman, args), culprit)
    assert not any(tmp_path.iterdir())


def test_stage_usage_error(project: Path) -> None:
    before = _tree(project)
    _usage_error(CliRunner().invoke(_stage("train"), ["--epochs", "3"]), "--epochs")
    assert _tree(project) == before
