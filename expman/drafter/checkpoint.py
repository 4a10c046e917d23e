"""Drafter checkpoint formats: the canonical speculators format, the EAGLE/SGLang export, import of both, and a
validator.

speculators format: ``config.json`` with ``speculators_model_type: eagle3``, ``transformer_layer_config``,
``speculators_config`` and aux ids in vLLM's convention; tensors ``fc``, ``layers.N.*``, ``norm``, ``lm_head``,
``embed_tokens``, ``d2t``, ``t2d``. ``vllm serve <dir>`` loads it directly.

EAGLE/SGLang format: a Llama config with ``architectures: [LlamaForCausalLMEagle3]``, ``draft_vocab_size`` and
``eagle_config.eagle_aux_hidden_state_layer_ids``; tensors ``midlayer.*`` instead of ``layers.0.*``, no embedding.
Its layer ids are written in the target engine's convention: ``vllm`` ids equal ours (HF ``hidden_states``
ids), ``sglang`` ids are one lower (output-of-layer). The convention is recorded in ``expman_layer_convention``;
an import without it must be told which convention the ids use: expman never guesses.

expman writes ``norm_before_residual`` in both formats. A config without it imports with the value the engines
read for its format: False for EAGLE (AQ-MedAI's Kimi-K2 drafter omits it), True for speculators.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import torch

from expman.drafter.model import DrafterConfig, Eagle3Drafter
from expman.errors import ExpmanError
from expman.provenance import atomic_dir

__all__ = [
    "export_eagle",
    "load_drafter",
    "norm_before_residual",
    "read_checkpoint",
    "read_config",
    "save_speculators",
    "validate_checkpoint",
    "write_eagle",
    "write_speculators",
]

Convention = Literal["vllm", "sglang"]
CONVENTION_SHIFT = {"vllm": 0, "sglang": 1}  # our id = file id + shift
EAGLE_ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_EXTRAS = ("verifier_", "input_norm")  # tensors speculators may save beside the drafter's; not ours


def _state(model: Eagle3Drafter) -> dict[str, torch.Tensor]:
    """The model's tensors under their canonical (state dict) names, without the rotary buffers."""
    return {
        name: tensor.detach().contiguous().cpu()
        for name, tensor in model.state_dict().items()
        if not name.startswith("rotary_emb.")
    }


def _write(folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    with atomic_dir(folder) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})


def save_speculators(
    model: Eagle3Drafter,
    folder: Path,
    verifier_name_or_path: str,
    verifier_architectures: list[str],
    speculative_tokens: int,
) -> None:
    """Write the canonical checkpoint (speculators format) to ``folder`` atomically."""
    write_speculators(
        model.config, _state(model), folder, verifier_name_or_path, verifier_architectures, speculative_tokens
    )


def write_speculators(
    config: DrafterConfig,
    tensors: dict[str, torch.Tensor],
    folder: Path,
    verifier_name_or_path: str | None,
    verifier_architectures: list[str],
    speculative_tokens: int,
) -> None:
    """Write canonically named ``tensors`` in speculators format; ``embed_tokens`` is kept only when present
    (an imported EAGLE checkpoint has none: engines take the verifier's)."""
    layer = {**config.layer, "architectures": ["LlamaForCausalLM"]}
    _write(
        folder,
        {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "draft_vocab_size": config.draft_vocab_size,
            "target_hidden_size": config.layer["hidden_size"],
            "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
            "norm_before_residual": config.norm_before_residual,
            "embed_requires_grad": False,
            "transformer_layer_config": layer,
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [
                    {
                        "proposal_type": "greedy",
                        "speculative_tokens": speculative_tokens,
                        "accept_tolerance": 0.0,
                        "verifier_accept_k": 1,
                    }
                ],
                "verifier": {"name_or_path": verifier_name_or_path, "architectures": verifier_architectures},
            },
            "expman_layer_convention": "vllm",
        },
        tensors,
    )


def export_eagle(model: Eagle3Drafter, folder: Path, convention: Convention) -> None:
    """Write the EAGLE/SGLang format with aux ids in ``convention`` (vllm: as is; sglang: one lower)."""
    write_eagle(model.config, _state(model), folder, convention)


def write_eagle(config: DrafterConfig, tensors: dict[str, torch.Tensor], folder: Path, convention: Convention) -> None:
    """Write canonically named ``tensors`` in EAGLE/SGLang format (``midlayer.*``, no embedding)."""
    ids = [i - CONVENTION_SHIFT[convention] for i in config.aux_layer_ids]
    _write(
        folder,
        {
            **config.layer,
            "architectures": [EAGLE_ARCHITECTURE],
            "num_hidden_layers": 1,
            "draft_vocab_size": config.draft_vocab_size,
            "target_hidden_size": config.layer["hidden_size"],
            "norm_before_residual": config.norm_before_residual,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
            "expman_layer_convention": convention,
        },
        {
            ("midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name): tensor
            for name, tensor in tensors.items()
            if name != "embed_tokens.weight"
        },
    )


def read_config(folder: Path) -> dict[str, Any]:
    """A checkpoint folder's ``config.json`` as it is written (no weights read)."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ExpmanError(f"{folder}: no config.json (not a drafter checkpoint folder)")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ExpmanError(f"{config_file}: not valid JSON") from None
    if not isinstance(config, dict):
        raise ExpmanError(f"{config_file}: expected a JSON object")
    return config


def _read(folder: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    config = read_config(folder)
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        raise ExpmanError(f"{folder}: no .safetensors weights (pickle checkpoints are not loaded)")
    tensors: dict[str, torch.Tensor] = {}
    for path in weights:
        try:
            tensors.update(load_file(str(path)))
        except Exception as err:  # safetensors raises its own error type for torn files
            raise ExpmanError(f"{path}: unreadable safetensors ({type(err).__name__}: {err})") from None
    return config, tensors


def _integer(value: Any) -> bool:
    """A JSON integer (not a bool, a float or a string)."""
    return isinstance(value, int) and not isinstance(value, bool)


def norm_before_residual(config: dict[str, Any]) -> bool:
    """The checkpoint config's ``norm_before_residual``; when it lacks the key, what the engines read for its format."""
    if "norm_before_residual" in config:
        return bool(config["norm_before_residual"])
    # speculators: vLLM's loader fills in True (vllm/transformers_utils/configs/speculators/algos.py, update_eagle3:
    # config_dict.get("norm_before_residual", True)). EAGLE: vLLM's drafter layer reads
    # getattr(config, "norm_before_residual", False) (vllm/model_executor/models/llama_eagle3.py); SGLang's
    # LlamaForCausalLMEagle3 (python/sglang/srt/models/llama_eagle3.py) keeps the raw residual too.
    return config.get("speculators_model_type") == "eagle3"


def _to_canonical(config: dict[str, Any], tensors: dict, convention: Convention | None, folder: Path) -> tuple:
    """(DrafterConfig, tensors named as Eagle3Drafter's state dict) from either format."""
    if config.get("speculators_model_type") == "eagle3":
        stated = config.get("expman_layer_convention", "vllm")  # speculators ids are vLLM's by definition
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        layer = config.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise ExpmanError(f"{folder}/config.json: transformer_layer_config must be an object, got {layer!r}")
        layer = dict(layer)
    elif EAGLE_ARCHITECTURE in config.get("architectures", []) or any(k.startswith("midlayer.") for k in tensors):
        stated = config.get("expman_layer_convention") or convention
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or config.get(
            "eagle_aux_hidden_state_layer_ids"
        )
        if stated is None:
            raise ExpmanError(
                f"{folder}/config.json: eagle_config.eagle_aux_hidden_state_layer_ids={ids} has no recorded "
                "convention; pass layer_convention vllm (ids as captured before layer i) or sglang (output of layer i)"
            )
        layer = {k: v for k, v in config.items() if k not in ("eagle_config", "architectures", "draft_vocab_size")}
        tensors = {
            ("layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k): v
            for k, v in tensors.items()
        }
    else:
        raise ExpmanError(f"{folder}/config.json: neither speculators (speculators_model_type) nor EAGLE format")
    if convention is not None and convention != stated:
        raise ExpmanError(f"{folder}/config.json: layer ids are in the {stated} convention, not {convention}")
    if not isinstance(ids, list) or len(ids) != 3 or not all(map(_integer, ids)):
        raise ExpmanError(f"{folder}/config.json: eagle_aux_hidden_state_layer_ids must list 3 layer ids, got {ids}")
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size")
    missing = [k for k in keys if k not in layer]
    if missing:
        raise ExpmanError(f"{folder}/config.json: layer config lacks {', '.join(missing)}")
    sizes = {**{k: layer[k] for k in keys}, "draft_vocab_size": config.get("draft_vocab_size")}
    wrong = [k for k, v in sizes.items() if not (_integer(v) and v > 0)]
    if wrong:
        raise ExpmanError(f"{folder}/config.json: {wrong[0]} must be a positive integer, got {sizes[wrong[0]]!r}")
    layer.setdefault("head_dim", layer["hidden_size"] // layer["num_attention_heads"])
    layer.setdefault("rms_norm_eps", 1e-6)
    if "rope_parameters" not in layer:
        layer["rope_parameters"] = {"rope_type": "default", "rope_theta": layer.get("rope_theta", 10000.0)}
    layer.pop("rope_theta", None)
    layer.pop("expman_layer_convention", None)
    layer.pop("target_hidden_size", None)
    layer.pop("norm_before_residual", None)
    layer["num_hidden_layers"] = 1 + max((int(k.split(".")[1]) for k in tensors if k.startswith("layers.")), default=0)
    drafter = DrafterConfig(
        layer={k: v for k, v in layer.items() if k != "architectures"},
        draft_vocab_size=int(config["draft_vocab_size"]),
        aux_layer_ids=tuple(int(i) + CONVENTION_SHIFT[stated] for i in ids),
        norm_before_residual=norm_before_residual(config),
    )
    return drafter, tensors


def _expected_shapes(config: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Canonical tensor names and shapes the config implies (rotary buffers excluded)."""
    with torch.device("meta"):  # shapes only: no memory for a 1B-parameter drafter
        state = Eagle3Drafter(config).state_dict()
    return {name: tuple(t.shape) for name, t in state.items() if not name.startswith("rotary_emb.")}


def validate_checkpoint(config: DrafterConfig, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Required tensors present with the shapes the config implies, no unknown ones; vocab maps consistent."""
    expected = _expected_shapes(config)
    unexpected = [k for k in tensors if k not in expected and not k.startswith(SPECULATORS_EXTRAS)]
    if unexpected:
        raise ExpmanError(f"{where}: unexpected tensors {', '.join(sorted(unexpected)[:5])}")
    expected.pop("embed_tokens.weight")  # optional: engines take the verifier's
    for name, shape in expected.items():
        if name not in tensors:
            raise ExpmanError(f"{where}: tensor {name} is missing")
        if tuple(tensors[name].shape) != shape:
            raise ExpmanError(f"{where}: tensor {name} has shape {list(tensors[name].shape)}, expected {list(shape)}")
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    if int(t2d.sum()) != config.draft_vocab_size:
        raise ExpmanError(f"{where}: t2d marks {int(t2d.sum())} ids, draft_vocab_size is {config.draft_vocab_size}")
    targets = torch.arange(config.draft_vocab_size) + d2t.long()
    if targets.min() < 0 or targets.max() >= t2d.numel():
        raise ExpmanError(f"{where}: d2t offsets map outside the target vocab of {t2d.numel()}")
    if not torch.equal(targets.sort().values, torch.nonzero(t2d).flatten()):
        raise ExpmanError(f"{where}: d2t and t2d disagree on the draft vocab")


def read_checkpoint(
    folder: Path, layer_convention: Convention | None = None
) -> tuple[dict[str, Any], DrafterConfig, dict[str, torch.Tensor]]:
    """Either format as (its config.json, DrafterConfig, canonically named tensors), validated; ids converted to
    ours. Needs no verifier: ``embed_tokens`` is among the tensors only when the file has it."""
    config, tensors = _read(folder)
    drafter_config, tensors = _to_canonical(config, tensors, layer_convention, folder)
    validate_checkpoint(drafter_config, tensors, str(folder))
    return config, drafter_config, {k: v for k, v in tensors.items() if not k.startswith(SPECULATORS_EXTRAS)}


def load_drafter(
    folder: Path, layer_convention: Convention | None = None, embedding: torch.Tensor | None = None
) -> Eagle3Drafter:
    """Load either format into an Eagle3Drafter (fp32), validated; ids converted to ours.

    ``embedding`` (the verifier's input embedding) is required when the checkpoint omits ``embed_tokens``,
    as EAGLE-format exports do.
    """
    _, drafter_config, tensors = read_checkpoint(folder, layer_convention)
    if "embed_tokens.weight" not in tensors:
        if embedding is None:
            raise ExpmanError(f"{folder}: embed_tokens is not in the checkpoint; load it with the verifier's embedding")
        shape = [drafter_config.layer["vocab_size"], drafter_config.layer["hidden_size"]]
        if list(embedding.shape) != shape:
            raise ExpmanError(
                f"{folder}: tensor embed_tokens.weight must be {shape}, the verifier's is {list(embedding.shape)} "
                "(a drafter for another verifier)"
            )
        tensors["embed_tokens.weight"] = embedding
    model = Eagle3Drafter(drafter_config)
    tensors = {
        k: v.to(torch.bool if k == "t2d" else torch.int64 if k == "d2t" else torch.float32) for k, v in tensors.items()
    }
    model.load_state_dict(tensors, strict=False)  # strict but for the rotary buffers, which files never hold
    return model
