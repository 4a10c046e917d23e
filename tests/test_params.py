"""params.yaml schema: the shipped file validates; each bad value is refused with one line naming its key."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from expman.cli import main
from expman.errors import ExpmanError
from expman.params import load_params

REPO = Path(__file__).resolve().parents[1]


def test_shipped_params_validate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    params = load_params("params.yaml")
    assert params.vocab.draft_vocab_size == 8192
    assert params.extract.final_state == "pre_norm"


def _set(data: dict, dotted: str, value: object) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        data = data[int(key)] if isinstance(data, list) else data[key]
    if value is DELETE:
        del data[last]
    else:
        data[last] = value


DELETE = object()
BAD = [
    ("trian", {"lr": 1}, "trian: unknown key"),
    ("generate.max_new_token", 5, "generate.max_new_token: unknown key"),
    ("vocab", DELETE, "vocab: required key is missing"),
    ("generate.batch_size", "eight", "generate.batch_size:"),
    ("generate.batch_size", 0, "generate.batch_size: Input should be greater than or equal to 1"),
    ("generate.temperature", -1.0, "generate.temperature:"),
    ("generate.backend", "tensorrt", "generate.backend:"),
    ("generate.datasets", [], "generate.datasets:"),
    ("generate.datasets.0.path", "nope.jsonl", "generate.datasets[0].path: file not found: nope.jsonl"),
    ("generate.datasets.0.split", "validation", "generate.datasets[0].split:"),
    ("generate.datasets.0.split", "heldout", "generate.datasets: at least one dataset must have split"),
    ("generate.datasets.0.max_samples", 0, "generate.datasets[0].max_samples:"),
    ("generate.chat_template_kwargs", "thinking", "generate.chat_template_kwargs:"),
    ("extract.aux_layers", [1, 2], "extract.aux_layers"),
    ("extract.aux_layers", [2, 2, 3], "extract.aux_layers"),
    ("extract.aux_layers", [-1, 2, 3], "extract.aux_layers"),
    ("extract.final_state", "middle", "extract.final_state:"),
    ("extract.max_seq_len", 0, "extract.max_seq_len:"),
    ("extract.device", "tpu", "extract.device:"),
    ("vocab.draft_vocab_size", -5, "vocab.draft_vocab_size"),
    ("vocab.draft_vocab_size", "big", "vocab.draft_vocab_size"),
    ("prepare.source", "missing/model", "prepare.source: not found: missing/model"),
    ("prepare.source", "package:not_a_package/x.gguf", "prepare.source: package 'not_a_package'"),
    ("prepare.source", "params.yaml", "prepare.source: params.yaml is neither"),
    ("prepare.trust_remote_code", "yes", "prepare.trust_remote_code:"),
    ("prepare.save_dtype", "int8", "prepare.save_dtype:"),
]


@pytest.mark.parametrize(("key", "value", "expected"), BAD, ids=[f"{k}={v!r}"[:40] for k, v, _ in BAD])
def test_bad_value_names_its_key(project: Path, key: str, value: object, expected: str) -> None:
    data = yaml.safe_load((project / "params.yaml").read_text())
    bad = copy.deepcopy(data)
    _set(bad, key, value)
    (project / "bad.yaml").write_text(yaml.safe_dump(bad))
    before = sorted(p.name for p in project.iterdir())
    with pytest.raises(ExpmanError) as caught:
        load_params("bad.yaml")
    message = str(caught.value)
    assert message.startswith("bad.yaml: ")
    assert expected in message
    assert "\n" not in message
    assert sorted(p.name for p in project.iterdir()) == before


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("prepare: [unclosed\n", "not valid YAML at line"),
        ("- a\n- b\n", "expected a mapping of stage sections"),
        ("", "expected a mapping of stage sections"),
    ],
)
def test_unreadable_file(project: Path, text: str, expected: str) -> None:
    (project / "bad.yaml").write_text(text)
    with pytest.raises(ExpmanError, match=expected):
        load_params("bad.yaml")


def test_missing_file(project: Path) -> None:
    with pytest.raises(ExpmanError, match="absent.yaml: params file not found"):
        load_params("absent.yaml")


def test_cli_check_ok_and_bad(project: Path) -> None:
    runner = CliRunner()
    ok = runner.invoke(main, ["params", "check"])
    assert ok.exit_code == 0, ok.output
    assert "params.yaml: ok" in ok.stdout
    (project / "bad.yaml").write_text((project / "params.yaml").read_text().replace("batch_size: 4", "batch_size: 0"))
    bad = runner.invoke(main, ["params", "check", "--params", "bad.yaml"])
    assert bad.exit_code == 2
    assert bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [
        "error: bad.yaml: generate.batch_size: Input should be greater than or equal to 1 (got 0)"
    ]
