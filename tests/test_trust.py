"""trust_remote_code is True only where the user set ``prepare.trust_remote_code``: the library passes only values
read from params or the verifier manifest, the schema defaults to False, and prepare refuses a verifier folder that
ships its own code (``auto_map``) without the setting, before any loader runs it."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import transformers
import yaml

from expman import paths
from expman.data.verifier import prepare
from expman.errors import ExpmanError
from expman.params import PrepareParams, load_params

REPO = Path(__file__).resolve().parents[1]
SETTING = "trust_remote_code"
Function = ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda


def _parameters(function: Function) -> list[ast.arg]:
    return function.args.posonlyargs + function.args.args + function.args.kwonlyargs


def _read_from_settings(value: ast.expr, function: Function | None) -> bool:
    """``section.trust_remote_code``, ``manifest["trust_remote_code"]``, or a parameter of that name that the
    enclosing function passes on (its callers are checked in turn)."""
    if isinstance(value, ast.Attribute):
        return value.attr == SETTING
    if isinstance(value, ast.Subscript):
        return isinstance(value.slice, ast.Constant) and value.slice.value == SETTING
    if isinstance(value, ast.Name) and value.id == SETTING and function is not None:
        return SETTING in [a.arg for a in _parameters(function)]
    return False


def violations(trees: dict[str, ast.Module]) -> tuple[list[str], int]:
    """Every place a trust_remote_code value is passed (keyword, dict entry, positional argument of a function with
    that parameter) or defaulted that is not read from params or a manifest; and how many places were checked."""
    takes = {}  # function name -> position of its trust_remote_code parameter
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                positional = [a.arg for a in node.args.posonlyargs + node.args.args]
                if SETTING in positional:
                    takes[node.name] = positional.index(SETTING)
    found, checked = [], 0
    for where, tree in trees.items():
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

        def enclosing(node: ast.AST, parents: dict = parents) -> Function | None:
            while node in parents:
                node = parents[node]
                if isinstance(node, Function):
                    return node
            return None

        for node in ast.walk(tree):
            values: list[ast.expr] = []
            if isinstance(node, ast.keyword) and node.arg == SETTING:
                values.append(node.value)
            elif isinstance(node, ast.Dict):
                entries = zip(node.keys, node.values, strict=True)
                values += [v for k, v in entries if isinstance(k, ast.Constant) and k.value == SETTING]
            elif isinstance(node, ast.Call):
                name = getattr(node.func, "id", getattr(node.func, "attr", None))
                if name in takes and len(node.args) > takes[name]:
                    values.append(node.args[takes[name]])
            elif isinstance(node, Function):
                arguments = node.args
                positional = reversed(arguments.posonlyargs + arguments.args)  # defaults belong to the last ones
                defaults = dict(zip(positional, reversed(arguments.defaults), strict=False))
                keywords = zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True)
                defaults |= {a: d for a, d in keywords if d is not None}
                for argument, default in defaults.items():
                    if argument.arg == SETTING:
                        checked += 1
                        if not (isinstance(default, ast.Constant) and default.value is False):
                            found.append(f"{where}:{default.lineno}: default {SETTING}={ast.unparse(default)}")
            for value in values:
                checked += 1
                if not _read_from_settings(value, enclosing(node)):
                    found.append(f"{where}:{value.lineno}: {SETTING}={ast.unparse(value)}")
    return found, checked


def test_trust_remote_code_is_only_read_from_params_or_manifests() -> None:
    trees = {
        str(path.relative_to(REPO)): ast.parse(path.read_text(encoding="utf-8"))
        for folder in ("expman", "stages")
        for path in sorted((REPO / folder).rglob("*.py"))
    }
    found, checked = violations(trees)
    assert not found
    assert checked >= 7, "the scan no longer sees where expman passes trust_remote_code"


def test_the_scan_catches_literals_and_unchecked_values() -> None:
    source = (
        "def load(path, trust_remote_code=True):\n"
        "    return f(path, trust_remote_code=True)\n"
        "def other(flag):\n"
        "    load('x', flag)\n"
        "    g(**{'trust_remote_code': flag})\n"
        "def fine(section, manifest):\n"
        "    load('x', section.trust_remote_code)\n"
        "    return f(trust_remote_code=manifest['trust_remote_code'])\n"
    )
    found, checked = violations({"snippet.py": ast.parse(source)})
    assert sorted(found) == [
        "snippet.py:1: default trust_remote_code=True",
        "snippet.py:2: trust_remote_code=True",
        "snippet.py:4: trust_remote_code=flag",
        "snippet.py:5: trust_remote_code=flag",
    ]
    assert checked == 6


def test_the_default_is_off(project: Path) -> None:
    assert PrepareParams.model_fields[SETTING].default is False
    assert SETTING not in Path("params.yaml").read_text()  # the tiny project leaves it to the default
    assert load_params("params.yaml").prepare.trust_remote_code is False
    assert yaml.safe_load((REPO / "params.yaml").read_text())["prepare"][SETTING] is False


CUSTOM_CODE = {
    "config.json": ("modeling_custom.py", {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}),
    "tokenizer_config.json": ("tokenization_custom.py", {"AutoTokenizer": ["tokenization_custom.Custom", None]}),
}


def _ship_code(folder: Path, where: str, marker: Path) -> None:
    """Give the tiny verifier code of its own, named by ``where``'s auto_map; the code leaves ``marker`` if run."""
    module, auto_map = CUSTOM_CODE[where]
    (folder / module).write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "from transformers import LlamaForCausalLM, PreTrainedTokenizerFast\n\n\n"
        "class CustomForCausalLM(LlamaForCausalLM):\n    pass\n\n\nclass Custom(PreTrainedTokenizerFast):\n    pass\n"
    )
    config = json.loads((folder / where).read_text())
    (folder / where).write_text(json.dumps({**config, "auto_map": auto_map}))


@pytest.mark.parametrize("where", sorted(CUSTOM_CODE))
def test_prepare_refuses_a_folder_with_its_own_code(project: Path, where: str) -> None:
    marker = project / "custom-code-ran"
    _ship_code(project / "tiny-verifier", where, marker)
    with pytest.raises(ExpmanError) as refused:
        prepare(load_params("params.yaml"), paths.VERIFIER)
    message = str(refused.value)
    assert f"tiny-verifier/{where}" in message and "prepare.trust_remote_code: true" in message
    assert "\n" not in message
    assert not marker.exists() and not paths.VERIFIER.exists()


def test_the_setting_reaches_the_loaders(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []

    def tokenizer(*args: object, **kwargs: object) -> object:
        seen.append(kwargs[SETTING])
        return object()

    def model(*args: object, **kwargs: object) -> object:
        seen.append(kwargs[SETTING])
        raise RuntimeError("stopped before loading")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tokenizer)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", model)
    params = yaml.safe_load(Path("params.yaml").read_text())
    for setting in (False, True):
        if setting:  # trusted: a folder with its own code goes to the loaders, which get the setting
            _ship_code(project / "tiny-verifier", "config.json", project / "custom-code-ran")
        params["prepare"][SETTING] = setting
        Path("params.yaml").write_text(yaml.safe_dump(params))
        with pytest.raises(ExpmanError, match="stopped before loading"):
            prepare(load_params("params.yaml"), paths.VERIFIER)
    assert seen == [False, False, True, True]
