"""Drafter checkpoint formats: speculators and EAGLE round trips, layer-id conventions, the validator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from expman.drafter.checkpoint import export_eagle, load_drafter, save_speculators
from expman.errors import ExpmanError
from tests.test_drafter import _drafter


def _vocab(model) -> None:
    ids = torch.tensor([0, 3, 4, 7, 9, 10, 11, 15, 20, 21, 22, 23, 30, 31, 32, 40, 41, 45, 48, 49])
    model.t2d.zero_()
    model.t2d[ids] = True
    model.d2t.copy_(ids - torch.arange(20))


def _logits(model) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    aux = torch.randn(1, 7, 48, generator=generator)
    ids = [torch.randint(0, 50, (1, 7), generator=generator) for _ in range(2)]
    with torch.no_grad():
        return model(aux, ids, torch.arange(7)[None], torch.zeros(1, 7, dtype=torch.long))


@pytest.fixture
def model():
    drafter = _drafter()
    _vocab(drafter)
    return drafter


def test_speculators_round_trip(model, tmp_path: Path) -> None:
    save_speculators(model, tmp_path / "ckpt", "models/verifier", ["LlamaForCausalLM"], speculative_tokens=3)
    config = json.loads((tmp_path / "ckpt/config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["norm_before_residual"] is False
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    names = set(load_file(str(tmp_path / "ckpt/model.safetensors")))
    assert {"fc.weight", "layers.0.hidden_norm.weight", "lm_head.weight", "d2t", "t2d", "embed_tokens.weight"} <= names
    loaded = load_drafter(tmp_path / "ckpt")
    assert loaded.config == model.config
    for a, b in zip(_logits(loaded), _logits(model), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize(("convention", "written"), [("vllm", [2, 4, 5]), ("sglang", [1, 3, 4])])
def test_eagle_export_and_import(model, tmp_path: Path, convention: str, written: list[int]) -> None:
    export_eagle(model, tmp_path / "eagle", convention)
    config = json.loads((tmp_path / "eagle/config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == written
    names = set(load_file(str(tmp_path / "eagle/model.safetensors")))
    assert "midlayer.self_attn.q_proj.weight" in names and "embed_tokens.weight" not in names
    loaded = load_drafter(tmp_path / "eagle", embedding=model.embed_tokens.weight)
    assert loaded.config.aux_layer_ids == (2, 4, 5)  # converted back to HF hidden_states ids
    for a, b in zip(_logits(loaded), _logits(model), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_foreign_eagle_checkpoint_needs_a_stated_convention(model, tmp_path: Path) -> None:
    """An AQ-MedAI-style config: eagle_config ids, no record of which engine's convention they use."""
    export_eagle(model, tmp_path / "aq", "sglang")
    config = json.loads((tmp_path / "aq/config.json").read_text())
    del config["expman_layer_convention"]
    (tmp_path / "aq/config.json").write_text(json.dumps(config))
    with pytest.raises(ExpmanError, match=r"eagle_aux_hidden_state_layer_ids=\[1, 3, 4\] has no recorded convention"):
        load_drafter(tmp_path / "aq", embedding=model.embed_tokens.weight)
    as_sglang = load_drafter(tmp_path / "aq", "sglang", embedding=model.embed_tokens.weight)
    as_vllm = load_drafter(tmp_path / "aq", "vllm", embedding=model.embed_tokens.weight)
    assert as_sglang.config.aux_layer_ids == (2, 4, 5) and as_vllm.config.aux_layer_ids == (1, 3, 4)


@pytest.mark.parametrize(("checkpoint_format", "engines_read"), [("eagle", False), ("speculators", True)])
def test_missing_norm_before_residual_imports_as_the_engines_read_it(
    model, tmp_path: Path, checkpoint_format: str, engines_read: bool
) -> None:
    """AQ-MedAI's Kimi-K2 drafter config has no norm_before_residual: vLLM's and SGLang's EAGLE-3 drafters then
    keep the raw residual (False); vLLM's speculators loader fills in True."""
    if checkpoint_format == "eagle":
        export_eagle(model, tmp_path / "ckpt", "vllm")
    else:
        save_speculators(model, tmp_path / "ckpt", "v", ["LlamaForCausalLM"], speculative_tokens=3)
    config = json.loads((tmp_path / "ckpt/config.json").read_text())
    del config["norm_before_residual"]
    (tmp_path / "ckpt/config.json").write_text(json.dumps(config))
    loaded = load_drafter(tmp_path / "ckpt", embedding=model.embed_tokens.weight)
    assert loaded.config.norm_before_residual is engines_read


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda t, c: t.pop("fc.weight"), "tensor fc.weight is missing"),
        (lambda t, c: t.update({"lm_head.weight": torch.zeros(21, 16)}), r"tensor lm_head.weight has shape \[21, 16\]"),
        (lambda t, c: t["t2d"].__setitem__(1, True), "t2d marks 21 ids, draft_vocab_size is 20"),
        (lambda t, c: t["d2t"].__setitem__(19, 100), "d2t offsets map outside the target vocab of 50"),
        (lambda t, c: c.update(eagle_aux_hidden_state_layer_ids=[2, 4]), "must list 3 layer ids"),
    ],
)
def test_validator_names_the_culprit(model, tmp_path: Path, damage, expected: str) -> None:
    save_speculators(model, tmp_path / "ckpt", "v", ["LlamaForCausalLM"], speculative_tokens=3)
    tensors = load_file(str(tmp_path / "ckpt/model.safetensors"))
    config = json.loads((tmp_path / "ckpt/config.json").read_text())
    damage(tensors, config)
    save_file(tensors, str(tmp_path / "ckpt/model.safetensors"))
    (tmp_path / "ckpt/config.json").write_text(json.dumps(config))
    with pytest.raises(ExpmanError, match=expected):
        load_drafter(tmp_path / "ckpt")


def test_pickle_only_checkpoint_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ExpmanError, match="no .safetensors weights"):
        load_drafter(tmp_path)
