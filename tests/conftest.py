"""Shared fixtures: a tiny random Llama verifier with a real BPE tokenizer and ChatML template, and a project.

The tiny verifier is made locally (no hub access): 6 layers, hidden 32, a BPE tokenizer trained on the
project's own prompts. ``project`` is a fresh project folder (cwd) with a few prompts and a params.yaml whose
verifier is that tiny model, and its own sqlite MLflow store.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


TRACKING_VARIABLES = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "EXPMAN_FEATURE_STORE")


@pytest.fixture(autouse=True)
def _no_tracking_store_across_tests() -> Iterator[None]:
    """No test inherits another's MLflow store (nor a feature store set in the environment): ``mlflow.set_tracking_uri``
    (which tests call to read a project's runs) exports ``MLFLOW_TRACKING_URI`` to the whole process, and a later test's
    stages would then write to that project's store, whose folder pytest may have removed."""
    for name in TRACKING_VARIABLES:
        os.environ.pop(name, None)
    yield
    if "mlflow" in sys.modules:
        import mlflow

        mlflow.set_tracking_uri(None)
        mlflow.set_registry_uri(None)
    for name in TRACKING_VARIABLES:
        os.environ.pop(name, None)


def _tiny_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [json.loads(line)["prompt"] for line in (REPO / "data/prompts/train.jsonl").read_text().splitlines()]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token="<|im_start|>"
    )
    fast.chat_template = CHATML
    fast.save_pretrained(folder)


def make_tiny_verifier(folder: Path, num_layers: int = 8, seed: int = 0, hidden_size: int = 32) -> Path:
    """A random 4-head Llama with a small BPE tokenizer; vLLM CPU serves it from ``hidden_size`` 128 (head size 32)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    _tiny_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger weights: varied generations; norm weights != 1: a double norm is visible
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0, 0.2)
            else:
                parameter.uniform_(0.5, 1.5)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_verifier_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF folder with the tiny random Llama (the input of prepare)."""
    return make_tiny_verifier(tmp_path_factory.mktemp("tiny-source"))


def write_prompts(folder: Path, split: str, count: int) -> None:
    lines = (REPO / f"data/prompts/{split}.jsonl").read_text(encoding="utf-8").splitlines()[:count]
    (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


def real_smollm2_params(folder: Path, prompts: dict[str, int], **generate: object) -> dict:
    """``folder`` as a project on the real SmolLM2: the first ``prompts[split]`` prompts of each split under
    ``prompts/``, and the repository's params.yaml alone (the folder has no presets/) with ``generate`` keys set.
    Returns the params to edit further; ``write_params`` saves and loads them."""
    (folder / "prompts").mkdir()
    for split, count in prompts.items():
        write_prompts(folder / "prompts", split, count)
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params.pop("preset")
    params["generate"].update(generate)
    return params


def write_params(params: dict, folder: Path = Path(".")):
    """``params`` as the folder's params.yaml, validated (the loaded ``Params``)."""
    from expman.params import load_params

    (folder / "params.yaml").write_text(yaml.safe_dump(params))
    return load_params(folder / "params.yaml")


def tiny_params(source: str) -> dict:
    return {
        "prepare": {"source": source},
        "generate": {
            "datasets": [
                {"path": "prompts/train.jsonl", "split": "train"},
                {"path": "prompts/heldout.jsonl", "split": "heldout"},
            ],
            "max_new_tokens": 12,
            "batch_size": 4,
            "shard_size": 4,
        },
        "extract": {"samples_per_shard": 3, "batch_tokens": 256},
        "vocab": {"draft_vocab_size": 64},
        "baseline": {"source": "train", "train": {"epochs": 1, "max_tokens": 160, "log_every": 2}},
        "train": {
            "epochs": 2,
            "max_tokens": 160,
            "log_every": 2,
            "checkpoint_every": 3,
            "val_fraction": 0.2,
            "features": "offline",  # extract tracks it in params.yaml (dvc.yaml): DVC needs the key there
        },
        "evaluate": {"ks": [1, 3], "max_prompts": 4, "max_new_tokens": 10},
        "benchmark": {"engine": "none"},  # vLLM cannot serve the tiny random model; the slow tier runs it
        "register": {"model_name": "auto"},
    }


@pytest.fixture
def project(tmp_path: Path, tiny_verifier_source: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A project folder (the cwd) with 10 train and 4 held-out prompts and a params.yaml for the tiny verifier."""
    shutil.copytree(tiny_verifier_source, tmp_path / "tiny-verifier")
    (tmp_path / "prompts").mkdir()
    write_prompts(tmp_path / "prompts", "train", 10)
    write_prompts(tmp_path / "prompts", "heldout", 4)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny_params("tiny-verifier"), sort_keys=False))
    monkeypatch.chdir(tmp_path)
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "DVC_EXP_NAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return tmp_path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """GPU tests are skipped, not failed, where torch sees no CUDA device."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
