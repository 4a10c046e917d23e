"""params.yaml schema: the shipped file validates; each bad value is refused with one line naming its key."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from expman.cli import main
from expman.errors import ExpmanError
from expman.params import STAGE_SECTIONS, load_params

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
    ("vocab", DELETE, 'section "vocab" is missing'),
    ("register", DELETE, 'section "register" is missing'),  # the schema has defaults for it; DVC tracks it
    ("train", None, 'section "train" must be a mapping of keys (got None)'),
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
    ("extract.gpus", 0, "extract.gpus: Input should be greater than or equal to 1"),
    ("vocab.draft_vocab_size", -5, "vocab.draft_vocab_size"),
    ("vocab.draft_vocab_size", "big", "vocab.draft_vocab_size"),
    ("prepare.source", "missing/model", "prepare.source: not found: missing/model"),
    ("prepare.source", "package:not_a_package/x.gguf", "prepare.source: package 'not_a_package'"),
    ("prepare.source", "params.yaml", "prepare.source: params.yaml is neither"),
    ("prepare.trust_remote_code", "yes", "prepare.trust_remote_code:"),
    ("prepare.save_dtype", "int8", "prepare.save_dtype:"),
    ("train.dtype", "float16", "train.dtype: Input should be 'auto', 'float32' or 'bfloat16'"),
    ("baseline.train.dtype", "float16", "baseline.train.dtype:"),
    ("train.gpus", 0, "train.gpus: Input should be greater than or equal to 1"),
    ("train.shard_window", 0, "train.shard_window:"),
    ("train.epochs", {"float32": 3}, "train.epochs: a mapping needs a count for both bfloat16 and float32"),
    ("train.epochs", {"bfloat16": 4, "float32": 0}, "train.epochs: epochs must be at least 1, got {'bfloat16': 4"),
    ("train.epochs", 0, "train.epochs: epochs must be at least 1, got 0"),
    ("train.nodes", 2, "train.rdzv_endpoint: required when nodes > 1"),
    ("train.rdzv_endpoint", "host0", "train.rdzv_endpoint: 'host0' is not host:port"),
    ("extract.backend", "sglang", "extract.backend: Input should be 'hf' or 'vllm'"),
    (
        "extract.tensor_parallel_size",
        2,
        "extract.tensor_parallel_size: tensor_parallel_size 2 needs extract.backend vllm",
    ),
    ("extract.expert_parallel", True, "extract.expert_parallel: expert_parallel needs extract.backend vllm"),
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


def test_expert_parallel_on_cpu_is_refused(project: Path) -> None:
    data = yaml.safe_load((project / "params.yaml").read_text())
    data["extract"] |= {"device": "cpu", "backend": "vllm", "expert_parallel": True}
    (project / "bad.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ExpmanError, match="^bad.yaml: extract.expert_parallel: expert_parallel needs GPUs: vLLM CPU"):
        load_params("bad.yaml")


def test_extract_over_several_gpus_on_cpu_is_refused(project: Path) -> None:
    data = yaml.safe_load((project / "params.yaml").read_text())
    data["extract"] |= {"device": "cpu", "gpus": 2}
    (project / "bad.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ExpmanError, match="bad.yaml: extract.gpus: .*2 GPUs need extract.device cuda or auto"):
        load_params("bad.yaml")


def test_sampled_responses_on_heldout_prompts_are_refused(project: Path) -> None:
    data = yaml.safe_load((project / "params.yaml").read_text())
    data["generate"]["datasets"][1]["sampled_responses"] = 2
    (project / "bad.yaml").write_text(yaml.safe_dump(data))
    expected = r"^bad.yaml: generate.datasets\[1\]: prompts/heldout.jsonl: sampled_responses on a heldout dataset"
    with pytest.raises(ExpmanError, match=expected):
        load_params("bad.yaml")


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


def _with_preset(project: Path, name: str, overlay: dict | str) -> None:
    data = yaml.safe_load((project / "params.yaml").read_text())
    data["preset"] = name
    (project / "params.yaml").write_text(yaml.safe_dump(data))
    (project / "presets").mkdir(exist_ok=True)
    text = overlay if isinstance(overlay, str) else yaml.safe_dump(overlay)
    (project / "presets" / f"{name}.yaml").write_text(text)


def test_preset_is_merged_over_params_key_by_key(project: Path) -> None:
    _with_preset(project, "quick", {"train": {"lr": 1e-3}, "baseline": {"train": {"epochs": 3}}, "evaluate": {}})
    params = load_params("params.yaml")
    assert params.preset == "quick"
    assert params.train.lr == 1e-3
    assert params.train.epochs == 2  # untouched keys of a section keep params.yaml's value
    assert params.baseline.train.epochs == 3
    assert params.baseline.train.max_tokens == 160  # nested sections merge too


def test_a_stage_section_only_the_preset_fills_is_an_error(project: Path) -> None:
    """dvc.yaml tracks each stage's section of params.yaml: a preset's empty section (no change) cannot stand in for
    one deleted from params.yaml."""
    assert set(STAGE_SECTIONS) == set(yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"])
    _with_preset(project, "quick", {name: {} for name in STAGE_SECTIONS})
    assert load_params("params.yaml").train.epochs == 2
    data = yaml.safe_load((project / "params.yaml").read_text())
    del data["train"]
    (project / "params.yaml").write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(main, ["params", "check"])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == ['error: params.yaml: section "train" is missing']


@pytest.mark.parametrize(
    ("name", "overlay", "expected"),
    [
        ("quick", {"train": {"lr": -1}}, r"presets/quick\.yaml: train\.lr:"),  # the preset named as the culprit
        ("quick", {"train": {"lrr": 1}}, r"presets/quick\.yaml: train\.lrr: unknown key"),
        ("quick", {"preset": "other"}, r"presets/quick\.yaml: preset: a preset cannot select another preset"),
        ("quick", "train: [unclosed\n", r"presets/quick\.yaml: not valid YAML at line \d"),
        ("quick", "- a\n", r"presets/quick\.yaml: expected a mapping"),
        ("../etc", {}, r"params\.yaml: preset: expected the name of a file in presets/"),
    ],
)
def test_bad_preset_names_the_file_and_key(project: Path, name: str, overlay: dict | str, expected: str) -> None:
    if name.startswith(".."):
        data = yaml.safe_load((project / "params.yaml").read_text()) | {"preset": name}
        (project / "params.yaml").write_text(yaml.safe_dump(data))
    else:
        _with_preset(project, name, overlay)
    with pytest.raises(ExpmanError, match=expected) as caught:
        load_params("params.yaml")
    assert "\n" not in str(caught.value)


def test_missing_preset_file(project: Path) -> None:
    data = yaml.safe_load((project / "params.yaml").read_text()) | {"preset": "fast"}
    (project / "params.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ExpmanError, match=r"params\.yaml: preset: presets/fast\.yaml not found"):
        load_params("params.yaml")


@pytest.mark.parametrize("preset", sorted(p.stem for p in (REPO / "presets").glob("*.yaml")))
def test_shipped_presets_validate_and_list_every_stage_section(
    preset: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dvc.yaml makes each stage track its own section of the selected preset, so every preset must have them."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    assert set(yaml.safe_load((REPO / "presets" / f"{preset}.yaml").read_text())) == set(stages)
    data = yaml.safe_load((REPO / "params.yaml").read_text()) | {"preset": preset}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data))
    (tmp_path / "presets").symlink_to(REPO / "presets")
    monkeypatch.chdir(REPO)  # the shipped params name files of the project
    params = load_params(tmp_path / "params.yaml")
    expected = {"default": (False, 0, 0), "quality": (True, 2, 320), "gpu": (True, 1, 12000)}[preset]
    generate = params.generate
    assert (params.train.norm_before_residual, generate.sampled_responses, generate.self_prompts.count) == expected
    if preset == "quality":  # one time budget on CPUs with and without native bf16: fp32 trains fewer epochs
        assert (params.train.resolved("bfloat16").epochs, params.train.resolved("float32").epochs) == (4, 3)
