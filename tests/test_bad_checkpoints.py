"""Bad drafter checkpoints, generated over the space: starting from a valid tiny checkpoint of each format, each
config key removed, of the wrong type or at odds with the tensors, each tensor missing, extra, of the wrong shape or
dtype, d2t/t2d out of range or of the wrong length. ``expman import`` must answer every one in one ``error:`` line
naming the culprit, exit 2 and leave the store untouched: a new user's first contact is a bad folder, not a
traceback (issue 51)."""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from expman.cli import main
from expman.drafter.checkpoint import export_eagle, load_drafter, save_speculators
from tests.registry_fixtures import use_store
from tests.test_checkpoint import _vocab
from tests.test_drafter import _drafter

Damage = Callable[[dict[str, Any], dict[str, torch.Tensor], Path], None]
"""Changes a valid checkpoint's config and tensors in place (or the folder, after they are written)."""

ARGS = {"speculators": [], "eagle": ["--layer-convention", "sglang"]}
"""The import flags of each format's valid checkpoint (the EAGLE one is exported in SGLang's convention)."""

REQUIRED = {
    "speculators": {
        ("speculators_model_type",),
        ("draft_vocab_size",),
        ("eagle_aux_hidden_state_layer_ids",),
        ("transformer_layer_config",),
        *(
            ("transformer_layer_config", k)
            for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size")
        ),
    },
    "eagle": {
        ("draft_vocab_size",),
        ("eagle_config",),
        ("eagle_config", "eagle_aux_hidden_state_layer_ids"),
        ("hidden_size",),
        ("intermediate_size",),
        ("num_attention_heads",),
        ("num_key_value_heads",),
        ("vocab_size",),
    },
}
"""Config keys without which a checkpoint is refused; any other may be left out (a default or not read)."""

SHAPE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "draft_vocab_size",
    "target_hidden_size",
    "num_hidden_layers",
)
"""Config keys that fix tensor shapes: one more than the tensors say is a disagreement."""


@functools.cache
def _valid(checkpoint_format: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The tiny drafter's config.json and tensors in ``checkpoint_format``, as its writer makes them."""
    model = _drafter()
    _vocab(model)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / checkpoint_format
        if checkpoint_format == "eagle":
            export_eagle(model, folder, "sglang")
        else:
            save_speculators(model, folder, "tiny-verifier", ["LlamaForCausalLM"], speculative_tokens=3)
        return json.loads((folder / "config.json").read_text()), load_file(str(folder / "model.safetensors"))


def _fresh(checkpoint_format: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A copy of the valid checkpoint to damage."""
    config, tensors = _valid(checkpoint_format)
    return copy.deepcopy(config), {k: v.clone() for k, v in tensors.items()}


def _leaves(node: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """(path, value) of every key and list element below ``node``, parents before children."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        yield (*path, key), value
        yield from _leaves(value, (*path, key))


def _wrong_types(value: Any) -> list[Any]:
    """Values of another JSON type than ``value`` (an integer also gets a float)."""
    if isinstance(value, bool):
        return ["yes"]
    if isinstance(value, int):
        return [str(value), value + 0.5]
    if isinstance(value, float):
        return [str(value)]
    if isinstance(value, str):
        return [7]
    if isinstance(value, list):
        return ["x"]
    return [7] if value is None else [[value]]


def _layer(checkpoint_format: str) -> tuple:
    """Where the layer's Llama keys sit in the config."""
    return ("transformer_layer_config",) if checkpoint_format == "speculators" else ()


def _set(path: tuple, value: Any) -> Damage:
    def damage(config: dict, tensors: dict, folder: Path) -> None:
        parent = functools.reduce(lambda node, key: node[key], path[:-1], config)
        parent[path[-1]] = value

    return damage


def _remove(path: tuple) -> Damage:
    def damage(config: dict, tensors: dict, folder: Path) -> None:
        del functools.reduce(lambda node, key: node[key], path[:-1], config)[path[-1]]

    return damage


def _tensor(name: str, value: torch.Tensor | None) -> Damage:
    """Replace tensor ``name`` (or add it); None removes it."""

    def damage(config: dict, tensors: dict, folder: Path) -> None:
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value

    return damage


def _edit(name: str, change: Callable[[torch.Tensor], None]) -> Damage:
    def damage(config: dict, tensors: dict, folder: Path) -> None:
        change(tensors[name])

    return damage


def _culprit(path: tuple) -> str:
    return next(str(k) for k in reversed(path) if isinstance(k, str))


def _config_cases(checkpoint_format: str, config: dict[str, Any]) -> Iterator[tuple[str, Damage, str]]:
    """(id, damage, culprit) of each config key removed (where required), of a wrong type, or at odds with the
    tensors."""
    for path, value in _leaves(config):
        name = ".".join(map(str, path))
        if path in REQUIRED[checkpoint_format]:
            yield f"{name}-removed", _remove(path), _culprit(path)
        for index, wrong in enumerate(_wrong_types(value)):
            yield f"{name}-wrong-type-{index}", _set(path, wrong), _culprit(path)
    layer = _layer(checkpoint_format)
    for key in SHAPE_KEYS:
        path = (*layer, key) if key not in ("draft_vocab_size", "target_hidden_size") else (key,)
        inner = functools.reduce(lambda node, k: node[k], path[:-1], config)
        yield f"{key}-disagrees", _set(path, inner[key] + 1), key
    yield "mlp_bias-without-biases", _set((*layer, "mlp_bias"), True), "mlp.gate_proj.bias"
    yield "attention_bias", _set((*layer, "attention_bias"), True), "attention_bias"
    yield "hidden_act-unknown", _set((*layer, "hidden_act"), "nope"), "hidden_act"
    yield "rms_norm_eps-zero", _set((*layer, "rms_norm_eps"), 0), "rms_norm_eps"
    yield "llama-key-transformers-refuses", _set((*layer, "use_cache"), "x"), "use_cache"
    yield "convention-unknown", _set(("expman_layer_convention",), "tgi"), "expman_layer_convention"
    yield "draft_vocab_size-zero", _set(("draft_vocab_size",), 0), "draft_vocab_size"
    ids = ("eagle_config", "eagle_aux_hidden_state_layer_ids") if layer == () else ("eagle_aux_hidden_state_layer_ids",)
    yield "layer-ids-two", _set(ids, [2, 4]), ids[-1]
    yield "layer-ids-negative", _set(ids, [-1, 3, 4]), ids[-1]
    if checkpoint_format == "speculators":
        yield "model-type-other", _set(("speculators_model_type",), "eagle"), "speculators_model_type"
        tokens = ("speculators_config", "proposal_methods", 0, "speculative_tokens")
        yield "speculative_tokens-zero", _set(tokens, 0), "speculative_tokens"
    else:
        yield "convention-other", _set(("expman_layer_convention",), "vllm"), "convention"
        # the issue's example: hidden_size and heads that fit no tensor, head_dim stated or implied
        issue = {"hidden_size": 640, "num_attention_heads": 9}
        yield "issue-51", lambda c, t, f: c.update(issue), "hidden_size 640"
        yield "issue-51-no-head-dim", lambda c, t, f: c.update(issue) or c.pop("head_dim"), "hidden_size 640"


def _tensor_cases(checkpoint_format: str, tensors: dict[str, torch.Tensor]) -> Iterator[tuple[str, Damage, str]]:
    """(id, damage, culprit) of each tensor missing, of the wrong shape, rank or dtype; extra tensors; bad maps."""
    for name, tensor in tensors.items():
        if name != "embed_tokens.weight":  # optional: engines take the verifier's
            yield f"{name}-missing", _tensor(name, None), name
        longer = torch.zeros(tensor.shape[0] + 1, *tensor.shape[1:], dtype=tensor.dtype)
        yield f"{name}-wrong-shape", _tensor(name, longer), name
        yield f"{name}-wrong-rank", _tensor(name, tensor[None]), name
        wrong = torch.float32 if name in ("d2t", "t2d") else torch.int32
        yield f"{name}-wrong-dtype", _tensor(name, torch.zeros(tensor.shape, dtype=wrong)), name
    first = "midlayer." if checkpoint_format == "eagle" else "layers.0."
    norm = torch.ones(16)
    yield "extra-unknown", _tensor("extra.weight", norm), "extra.weight"
    yield "extra-layer", _tensor("layers.1.input_layernorm.weight", norm), "layers.1.input_layernorm.weight"
    yield "extra-bias", _tensor(f"{first}self_attn.q_proj.bias", norm), f"{first}self_attn.q_proj.bias"
    if checkpoint_format == "eagle":
        yield "extra-both-namings", _tensor("layers.0.input_layernorm.weight", norm), "layers.0.input_layernorm"
    yield "d2t-past-vocab", _edit("d2t", lambda t: t.__setitem__(-1, 100)), "d2t"
    yield "d2t-negative", _edit("d2t", lambda t: t.__setitem__(0, -1)), "d2t"
    yield "d2t-short", _tensor("d2t", tensors["d2t"][:-1]), "d2t"
    yield "t2d-short", _tensor("t2d", tensors["t2d"][:-1]), "t2d"
    yield "t2d-one-more", _edit("t2d", lambda t: t.__setitem__(1, True)), "t2d"
    yield "t2d-one-less", _edit("t2d", lambda t: t.__setitem__(0, False)), "t2d"
    yield "t2d-not-0-1", _tensor("t2d", tensors["t2d"].to(torch.int64) * 2), "t2d"
    moved = tensors["t2d"].clone()
    moved[[0, 1]] = moved[[1, 0]]
    yield "d2t-t2d-disagree", _tensor("t2d", moved), "d2t and t2d"


def _file_cases() -> Iterator[tuple[str, Damage, str]]:
    """Damage to the folder itself, after the valid files are written."""

    def duplicate(config: dict, tensors: dict, folder: Path) -> None:
        save_file({"norm.weight": tensors["norm.weight"]}, str(folder / "model-2.safetensors"))

    def truncate(config: dict, tensors: dict, folder: Path) -> None:
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[: len(data) // 2])

    yield "duplicate-tensor", duplicate, "norm.weight"
    yield "truncated", truncate, "model.safetensors"
    yield "no-weights", lambda c, t, f: (f / "model.safetensors").unlink(), "no .safetensors"
    yield "config-not-json", lambda c, t, f: (f / "config.json").write_text("{"), "config.json"
    yield "no-config", lambda c, t, f: (f / "config.json").unlink(), "no config.json"


def _cases() -> list[Any]:
    """Every case of both formats as pytest params (format, damage, culprit, damaged after the files are written)."""
    cases = []
    for checkpoint_format in ARGS:
        config, tensors = _valid(checkpoint_format)
        before = [*_config_cases(checkpoint_format, config), *_tensor_cases(checkpoint_format, tensors)]
        for case_id, damage, culprit in before:
            cases.append(pytest.param(checkpoint_format, damage, culprit, False, id=f"{checkpoint_format}-{case_id}"))
        for case_id, damage, culprit in _file_cases():
            cases.append(pytest.param(checkpoint_format, damage, culprit, True, id=f"{checkpoint_format}-{case_id}"))
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One empty tracking store for every case: none may write to it."""
    root = tmp_path_factory.mktemp("store")
    with pytest.MonkeyPatch.context() as patch:
        use_store(root, patch)
    return root


@pytest.fixture
def store(shared_store: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(shared_store)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{shared_store / 'mlflow.db'}")
    for name in ("MLFLOW_REGISTRY_URI", "MLFLOW_EXPERIMENT_NAME", "DVC_EXP_NAME"):
        monkeypatch.delenv(name, raising=False)
    return shared_store


def _write(folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))


def _snapshot(store: Path) -> dict[str, str]:
    return {
        str(p.relative_to(store)): hashlib.sha256(p.read_bytes()).hexdigest() for p in store.rglob("*") if p.is_file()
    }


@pytest.mark.parametrize(("checkpoint_format", "damage", "culprit", "after"), CASES)
def test_bad_checkpoint_is_one_line(
    store: Path, tmp_path: Path, checkpoint_format: str, damage: Damage, culprit: str, after: bool
) -> None:
    """One ``error:`` line naming the culprit, exit 2 (not a crash's 1), no traceback, nothing written."""
    config, tensors = _fresh(checkpoint_format)
    folder = tmp_path / "drafter"
    if not after:
        damage(config, tensors, folder)
    _write(folder, config, tensors)
    if after:
        damage(config, tensors, folder)
    before = _snapshot(store)
    result = CliRunner().invoke(main, ["import", str(folder), "--name", "eagle3-tiny", *ARGS[checkpoint_format]])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
    assert culprit in result.stderr and "Traceback" not in result.output, result.stderr
    assert result.stdout == ""
    assert _snapshot(store) == before  # nothing registered, no run opened


OPTIONAL = [
    pytest.param(checkpoint_format, path, id=f"{checkpoint_format}-{'.'.join(map(str, path))}")
    for checkpoint_format in ARGS
    for path, _ in _leaves(_valid(checkpoint_format)[0])
    if isinstance(path[-1], str) and path not in REQUIRED[checkpoint_format]
]


@pytest.mark.parametrize(("checkpoint_format", "path"), OPTIONAL)
def test_optional_key_removed_still_loads(tmp_path: Path, checkpoint_format: str, path: tuple) -> None:
    """A key with a default (or one expman does not read) may be left out: the drafter still loads."""
    config, tensors = _fresh(checkpoint_format)
    _remove(path)(config, tensors, tmp_path)
    _write(tmp_path / "drafter", config, tensors)
    convention = "sglang" if checkpoint_format == "eagle" else None
    load_drafter(tmp_path / "drafter", convention, embedding=torch.zeros(50, 16))


@pytest.mark.parametrize("checkpoint_format", ARGS)
def test_valid_checkpoint_imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, checkpoint_format: str) -> None:
    """The starting point of every case imports: each refusal above is the damage's doing."""
    use_store(tmp_path, monkeypatch)
    _write(tmp_path / "drafter", *_fresh(checkpoint_format))
    args = ["import", str(tmp_path / "drafter"), "--name", "eagle3-tiny", *ARGS[checkpoint_format]]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
