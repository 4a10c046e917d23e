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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from transformers.activations import ACT2FN

from expman.drafter.model import DrafterConfig, Eagle3Drafter
from expman.errors import ExpmanError
from expman.provenance import atomic_dir, sha256_file

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


def _integer(value: Any) -> bool:
    """A JSON integer (not a bool, a float or a string)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    """A JSON number (not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


Rule = tuple[str, Callable[[Any], bool]]
"""What a config value must be (the end of the error line) and the test of it."""

POSITIVE_INT: Rule = ("must be a positive integer", lambda v: _integer(v) and v > 0)
POSITIVE_NUMBER: Rule = ("must be a positive number", lambda v: _number(v) and v > 0)
NUMBER: Rule = ("must be a number", _number)
BOOL: Rule = ("must be true or false", lambda v: isinstance(v, bool))
STRING: Rule = ("must be a string", lambda v: isinstance(v, str))
NAME: Rule = ("must be a string or null", lambda v: v is None or isinstance(v, str))
STRINGS: Rule = ("must be a list of strings", lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v))
OBJECT: Rule = ("must be an object", lambda v: isinstance(v, dict))
OBJECTS: Rule = ("must be a list of objects", lambda v: isinstance(v, list) and all(isinstance(o, dict) for o in v))
CONVENTION: Rule = ("must be vllm or sglang", lambda v: isinstance(v, str) and v in CONVENTION_SHIFT)
LAYER_IDS: Rule = (
    "must list 3 layer ids",
    lambda v: isinstance(v, list) and len(v) == 3 and all(_integer(i) and i >= 0 for i in v),
)
ACTIVATION: Rule = ("must name a transformers activation", lambda v: isinstance(v, str) and v in ACT2FN)

LAYER_KEYS: dict[str, tuple[Rule, bool]] = {
    "hidden_size": (POSITIVE_INT, True),
    "intermediate_size": (POSITIVE_INT, True),
    "num_attention_heads": (POSITIVE_INT, True),
    "num_key_value_heads": (POSITIVE_INT, True),
    "vocab_size": (POSITIVE_INT, True),
    "head_dim": (POSITIVE_INT, False),
    "num_hidden_layers": (POSITIVE_INT, False),
    "max_position_embeddings": (POSITIVE_INT, False),
    "rms_norm_eps": (POSITIVE_NUMBER, False),
    "rope_theta": (POSITIVE_NUMBER, False),
    "rope_parameters": (OBJECT, False),
    "rope_parameters.rope_theta": (POSITIVE_NUMBER, False),
    "rope_parameters.rope_type": (STRING, False),
    "hidden_act": (ACTIVATION, False),
    "attention_bias": (BOOL, False),
    "mlp_bias": (BOOL, False),
    "tie_word_embeddings": (BOOL, False),
    "model_type": (STRING, False),
    "architectures": (STRINGS, False),
}
"""The drafter layer's Llama config (speculators' ``transformer_layer_config``, EAGLE's top level): key path (``a.b``
inside an object, ``a[].b`` in each element of a list) -> (rule, required). Keys not listed go to transformers'
LlamaConfig as they are."""

TOP_KEYS: dict[str, tuple[Rule, bool]] = {
    "architectures": (STRINGS, False),
    "draft_vocab_size": (POSITIVE_INT, True),
    "target_hidden_size": (POSITIVE_INT, False),
    "norm_before_residual": (BOOL, False),
    "expman_layer_convention": (CONVENTION, False),
}
SPECULATORS_KEYS: dict[str, tuple[Rule, bool]] = {
    **TOP_KEYS,
    "eagle_aux_hidden_state_layer_ids": (LAYER_IDS, True),
    "embed_requires_grad": (BOOL, False),
    "transformer_layer_config": (OBJECT, True),
    "speculators_config": (OBJECT, False),
    "speculators_config.algorithm": (STRING, False),
    "speculators_config.default_proposal_method": (STRING, False),
    "speculators_config.proposal_methods": (OBJECTS, False),
    "speculators_config.proposal_methods[].proposal_type": (STRING, False),
    "speculators_config.proposal_methods[].speculative_tokens": (POSITIVE_INT, False),
    "speculators_config.proposal_methods[].accept_tolerance": (NUMBER, False),
    "speculators_config.proposal_methods[].verifier_accept_k": (POSITIVE_INT, False),
    "speculators_config.verifier": (OBJECT, False),
    "speculators_config.verifier.name_or_path": (NAME, False),
    "speculators_config.verifier.architectures": (STRINGS, False),
}
EAGLE_KEYS: dict[str, tuple[Rule, bool]] = {
    **LAYER_KEYS,
    **TOP_KEYS,
    "eagle_config": (OBJECT, False),
    "eagle_config.eagle_aux_hidden_state_layer_ids": (LAYER_IDS, False),
    "eagle_config.use_aux_hidden_state": (BOOL, False),
    "eagle_aux_hidden_state_layer_ids": (LAYER_IDS, False),
}

FLOAT = (("float",), "a floating-point dtype")
INDEX = (("int",), "an integer dtype")
MASK = (("bool", "int"), "bool or an integer dtype")


@dataclass(frozen=True)
class _Header:
    """One tensor as a safetensors header lists it: no data read."""

    path: Path
    shape: list[int]
    dtype: str

    @property
    def kind(self) -> str:
        """float, int or bool (safetensors dtypes F16, BF16, F8_*, I64, U8, BOOL...); else the dtype itself."""
        if self.dtype == "BOOL":
            return "bool"
        if self.dtype.startswith(("F", "BF")):
            return "float"
        return "int" if self.dtype.startswith(("I", "U")) else self.dtype


def _present(node: Any, path: str, name: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted name, value) of each value ``path`` reaches in ``node``; absent keys reach nothing."""
    head, _, rest = path.partition(".")
    key = head.removesuffix("[]")
    if not isinstance(node, dict) or key not in node:
        return
    value, name = node[key], name + key
    if head.endswith("[]"):  # the list itself was checked first (rules are in order)
        for index, item in enumerate(value):
            yield from _present(item, rest, f"{name}[{index}].")
    elif rest:
        yield from _present(value, rest, name + ".")
    else:
        yield name, value


def _check_keys(config: dict[str, Any], rules: dict[str, tuple[Rule, bool]], where: Path) -> None:
    """Each key of ``rules`` present when required and of its type, in the rules' order."""
    for path, ((must, test), required) in rules.items():
        if required and path not in config:
            raise ExpmanError(f"{where}: {path} is missing")
        for name, value in _present(config, path):
            if not test(value):
                raise ExpmanError(f"{where}: {name} {must}, got {value!r}")


def _headers(folder: Path) -> dict[str, _Header]:
    """Every tensor's name, shape and dtype from the safetensors headers of ``folder`` (no tensor loaded)."""
    from safetensors import safe_open

    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        raise ExpmanError(f"{folder}: no .safetensors weights (pickle checkpoints are not loaded)")
    found: dict[str, _Header] = {}
    for path in weights:
        try:
            with safe_open(str(path), "pt") as file:
                slices = {name: file.get_slice(name) for name in file.keys()}  # noqa: SIM118 (not a dict)
                listed = {name: (list(s.get_shape()), s.get_dtype()) for name, s in slices.items()}
        except Exception as err:  # safetensors raises its own error types for torn files
            raise ExpmanError(f"{path}: unreadable safetensors ({type(err).__name__}: {_one_line(err)})") from None
        for name, (shape, dtype) in listed.items():
            if name in found:
                raise ExpmanError(f"{path}: tensor {name} is also in {found[name].path.name}")
            found[name] = _Header(path, shape, dtype)
    return found


def weights_sha256(folder: Path) -> str:
    """The digest of a drafter's weights: its one safetensors file's sha256, or, for weights split over several
    files, the sha256 of each file's name and digest, so a finetune's input is named whatever its files are called."""
    import hashlib

    files = sorted(folder.glob("*.safetensors"))
    if len(files) == 1:
        return sha256_file(files[0])
    listed = json.dumps({file.name: sha256_file(file) for file in files}, sort_keys=True)
    return hashlib.sha256(listed.encode()).hexdigest()


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())


def _load(headers: dict[str, _Header]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted({h.path for h in headers.values()}):
        try:
            tensors.update(load_file(str(path)))
        except Exception as err:  # safetensors raises its own error types for torn files
            raise ExpmanError(f"{path}: unreadable safetensors ({type(err).__name__}: {_one_line(err)})") from None
    return tensors


def norm_before_residual(config: dict[str, Any]) -> bool:
    """The checkpoint config's ``norm_before_residual``; when it lacks the key, what the engines read for its format."""
    if "norm_before_residual" in config:
        return bool(config["norm_before_residual"])
    # speculators: vLLM's loader fills in True (vllm/transformers_utils/configs/speculators/algos.py, update_eagle3:
    # config_dict.get("norm_before_residual", True)). EAGLE: vLLM's drafter layer reads
    # getattr(config, "norm_before_residual", False) (vllm/model_executor/models/llama_eagle3.py); SGLang's
    # LlamaForCausalLMEagle3 (python/sglang/srt/models/llama_eagle3.py) keeps the raw residual too.
    return config.get("speculators_model_type") == "eagle3"


def _format(config: dict[str, Any], names: Iterable[str], where: Path) -> str:
    """speculators or eagle, from the config (and the tensor names of an EAGLE export without architectures)."""
    if "speculators_model_type" in config:
        if config["speculators_model_type"] != "eagle3":
            raise ExpmanError(
                f"{where}: speculators_model_type must be eagle3, got {config['speculators_model_type']!r}"
            )
        return "speculators"
    architectures = config.get("architectures")
    if (isinstance(architectures, list) and EAGLE_ARCHITECTURE in architectures) or any(
        name.startswith("midlayer.") for name in names
    ):
        return "eagle"
    raise ExpmanError(f"{where}: neither speculators (speculators_model_type) nor EAGLE format")


def _file_name(name: str, eagle: bool) -> str:
    """A canonical tensor name as the checkpoint's format writes it (EAGLE: ``midlayer.*`` for layer 0)."""
    return "midlayer." + name.removeprefix("layers.0.") if eagle and name.startswith("layers.0.") else name


def _layer_count(names: Iterable[str], eagle: bool) -> int:
    """How many decoder layers the tensor names hold (EAGLE's ``midlayer`` is layer 0)."""
    indices = {int(n.split(".")[1]) for n in names if n.startswith("layers.") and n.split(".")[1].isdigit()}
    if eagle and any(n.startswith("midlayer.") for n in names):
        indices.add(0)
    return max(indices, default=-1) + 1


Dim = tuple[int, str]
"""A tensor dimension the config implies, and the keys that imply it (for the error line)."""


def _expected(layer: dict[str, Any], config: dict[str, Any], layers: int) -> dict[str, tuple[tuple[Dim, ...], tuple]]:
    """Canonical tensor name -> (shape, accepted dtypes) the config implies, tensors that pin one key first, so a
    disagreement names that key. ``embed_tokens.weight`` (last) is optional."""
    size, heads, kv_heads = layer["hidden_size"], layer["num_attention_heads"], layer["num_key_value_heads"]
    head_dim = layer.get("head_dim") or size // heads
    head = (
        f"head_dim {head_dim}" if "head_dim" in layer else f"head_dim {head_dim} (hidden_size // num_attention_heads)"
    )
    hidden: Dim = (size, f"hidden_size {size}")
    inner: Dim = (layer["intermediate_size"], f"intermediate_size {layer['intermediate_size']}")
    draft: Dim = (config["draft_vocab_size"], f"draft_vocab_size {config['draft_vocab_size']}")
    vocab: Dim = (layer["vocab_size"], f"vocab_size {layer['vocab_size']}")
    queries: Dim = (heads * head_dim, f"num_attention_heads {heads} × {head}")
    keys: Dim = (kv_heads * head_dim, f"num_key_value_heads {kv_heads} × {head}")
    target = config.get("target_hidden_size")
    fc_in: Dim = (3 * target, f"3 × target_hidden_size {target}") if target else (3 * size, f"3 × hidden_size {size}")
    shapes: dict[str, tuple[tuple[Dim, ...], tuple]] = {
        "norm.weight": ((hidden,), FLOAT),
        "lm_head.weight": ((draft, hidden), FLOAT),
        "d2t": ((draft,), INDEX),
        "t2d": ((vocab,), MASK),
    }
    for index in range(layers):
        prefix = f"layers.{index}."
        wide: Dim = (2 * size, f"2 × hidden_size {size}") if index == 0 else hidden
        shapes[prefix + "input_layernorm.weight"] = ((hidden,), FLOAT)
        if index == 0:
            shapes[prefix + "hidden_norm.weight"] = ((hidden,), FLOAT)
        shapes[prefix + "post_attention_layernorm.weight"] = ((hidden,), FLOAT)
        shapes[prefix + "mlp.gate_proj.weight"] = ((inner, hidden), FLOAT)
        shapes[prefix + "mlp.up_proj.weight"] = ((inner, hidden), FLOAT)
        shapes[prefix + "mlp.down_proj.weight"] = ((hidden, inner), FLOAT)
        if layer.get("mlp_bias"):
            shapes.update({prefix + f"mlp.{p}_proj.bias": ((inner,), FLOAT) for p in ("gate", "up")})
            shapes[prefix + "mlp.down_proj.bias"] = ((hidden,), FLOAT)
        shapes[prefix + "self_attn.o_proj.weight"] = ((hidden, queries), FLOAT)
        shapes[prefix + "self_attn.q_proj.weight"] = ((queries, wide), FLOAT)
        shapes[prefix + "self_attn.k_proj.weight"] = ((keys, wide), FLOAT)
        shapes[prefix + "self_attn.v_proj.weight"] = ((keys, wide), FLOAT)
    shapes["fc.weight"] = ((hidden, fc_in), FLOAT)
    shapes["embed_tokens.weight"] = ((vocab, hidden), FLOAT)
    return shapes


def _check_tensors(
    headers: dict[str, _Header], layer: dict[str, Any], config: dict[str, Any], eagle: bool, folder: Path
) -> int:
    """The tensors the config implies, by name, shape and dtype, and no others; returns the number of layers."""
    config_file = folder / "config.json"
    count, stated = _layer_count(headers, eagle), layer.get("num_hidden_layers")
    if stated is not None and count > stated:
        culprit = next(n for n in sorted(headers) if _layer_count([n], eagle) == count)
        raise ExpmanError(
            f"{config_file}: num_hidden_layers {stated} disagrees with tensor {culprit} (layer {count - 1})"
        )
    if stated is not None and 0 < count < stated:
        first = _file_name(f"layers.{count}.", eagle)
        raise ExpmanError(f"{config_file}: num_hidden_layers {stated} disagrees with the tensors: no {first}* tensor")
    layers = stated or count or 1
    expected = {_file_name(name, eagle): spec for name, spec in _expected(layer, config, layers).items()}
    unexpected = sorted(n for n in headers if n not in expected and not n.startswith(SPECULATORS_EXTRAS))
    if unexpected:
        raise ExpmanError(f"{headers[unexpected[0]].path}: unexpected tensors {', '.join(unexpected[:5])}")
    files = {h.path for h in headers.values()}
    where = next(iter(files)) if len(files) == 1 else folder
    for name, (dims, (kinds, described)) in expected.items():
        header = headers.get(name)
        if header is None:
            if name == "embed_tokens.weight":  # optional: engines take the verifier's
                continue
            raise ExpmanError(f"{where}: tensor {name} is missing")
        shape = [d for d, _ in dims]
        if header.shape != shape:
            culprits = [k for (d, k), a in zip(dims, header.shape, strict=False) if d != a]
            why = culprits[0] if len(header.shape) == len(dims) else " and ".join(k for _, k in dims)
            raise ExpmanError(
                f"{header.path}: tensor {name} has shape {header.shape}, but config.json ({why}) implies {shape}"
            )
        if header.kind not in kinds:
            raise ExpmanError(f"{header.path}: tensor {name} has dtype {header.dtype}, expected {described}")
    return layers


def _check_layer(layer: dict[str, Any], config: dict[str, Any], config_file: Path) -> None:
    """What the drafter and transformers need of the layer config beyond shapes the tensors agree with."""
    size, heads, kv_heads = layer["hidden_size"], layer["num_attention_heads"], layer["num_key_value_heads"]
    if size % heads:
        raise ExpmanError(f"{config_file}: hidden_size {size} is not a multiple of num_attention_heads {heads}")
    if heads % kv_heads:
        raise ExpmanError(
            f"{config_file}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
        )
    head_dim = layer.get("head_dim") or size // heads
    if head_dim % 2:
        raise ExpmanError(f"{config_file}: head_dim {head_dim} is odd; rotary embeddings need an even one")
    if config.get("target_hidden_size", size) != size:
        raise ExpmanError(
            f"{config_file}: target_hidden_size {config['target_hidden_size']} differs from hidden_size {size} "
            "(the drafter reads the verifier's states at its own width)"
        )
    if layer.get("attention_bias"):
        raise ExpmanError(f"{config_file}: attention_bias true: the drafter's attention has no biases")


def _check_maps(tensors: dict[str, torch.Tensor], draft_vocab_size: int, where: Path) -> None:
    """t2d marks the draft vocab's target ids, d2t maps each draft id to one of them."""
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    if t2d.dtype != torch.bool and not bool(((t2d == 0) | (t2d == 1)).all()):
        raise ExpmanError(f"{where}: t2d holds values other than 0 and 1")
    marked = int(t2d.bool().sum())
    if marked != draft_vocab_size:
        raise ExpmanError(f"{where}: t2d marks {marked} ids, draft_vocab_size is {draft_vocab_size}")
    targets = torch.arange(draft_vocab_size) + d2t.long()
    if targets.min() < 0 or targets.max() >= t2d.numel():
        raise ExpmanError(f"{where}: d2t offsets map outside the target vocab of {t2d.numel()}")
    if not torch.equal(targets.sort().values, torch.nonzero(t2d).flatten()):
        raise ExpmanError(f"{where}: d2t and t2d disagree on the draft vocab")


def validate_checkpoint(
    folder: Path, convention: Convention | None = None
) -> tuple[dict[str, Any], DrafterConfig, dict[str, _Header]]:
    """Either format's config.json against its safetensors headers, before any tensor is loaded or library class
    built: (the config as written, the DrafterConfig with ids converted to ours, the headers under the file's names).

    Each key the drafter reads is present when required and of its type, every tensor the config implies is there
    with its shape and dtype and no other is, and transformers accepts the layer config; else one ExpmanError line
    naming the file and the key or tensor."""
    config_file = folder / "config.json"
    config = read_config(folder)
    headers = _headers(folder)
    eagle = _format(config, headers, config_file) == "eagle"
    _check_keys(config, EAGLE_KEYS if eagle else SPECULATORS_KEYS, config_file)
    if eagle:
        stated = config.get("expman_layer_convention") or convention
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or config.get(
            "eagle_aux_hidden_state_layer_ids"
        )
        if ids is None:
            raise ExpmanError(f"{config_file}: eagle_config.eagle_aux_hidden_state_layer_ids is missing")
        if stated is None:
            raise ExpmanError(
                f"{config_file}: eagle_config.eagle_aux_hidden_state_layer_ids={ids} has no recorded "
                "convention; pass layer_convention vllm (ids as captured before layer i) or sglang (output of layer i)"
            )
        layer = {k: v for k, v in config.items() if k not in ("eagle_config", "architectures", "draft_vocab_size")}
    else:
        stated = config.get("expman_layer_convention", "vllm")  # speculators ids are vLLM's by definition
        ids = config["eagle_aux_hidden_state_layer_ids"]
        _check_keys(config["transformer_layer_config"], LAYER_KEYS, config_file)
        layer = dict(config["transformer_layer_config"])
    if convention is not None and convention != stated:
        raise ExpmanError(f"{config_file}: layer ids are in the {stated} convention, not {convention}")
    layer["num_hidden_layers"] = _check_tensors(headers, layer, config, eagle, folder)
    _check_layer(layer, config, config_file)
    layer.setdefault("head_dim", layer["hidden_size"] // layer["num_attention_heads"])
    layer["rms_norm_eps"] = float(layer.get("rms_norm_eps", 1e-6))  # transformers refuses an int
    if "rope_parameters" not in layer:
        layer["rope_parameters"] = {"rope_type": "default", "rope_theta": layer.get("rope_theta", 10000.0)}
    for key in ("rope_theta", "expman_layer_convention", "target_hidden_size", "norm_before_residual", "architectures"):
        layer.pop(key, None)
    drafter = DrafterConfig(
        layer=layer,
        draft_vocab_size=config["draft_vocab_size"],
        aux_layer_ids=tuple(i + CONVENTION_SHIFT[stated] for i in ids),
        norm_before_residual=norm_before_residual(config),
    )
    try:
        _ = drafter.llama  # transformers validates the LlamaConfig it builds
    except Exception as err:  # transformers' strict config validation raises several error types
        raise ExpmanError(f"{config_file}: transformers refuses the layer config: {_one_line(err)}") from None
    return config, drafter, headers


def read_checkpoint(
    folder: Path, layer_convention: Convention | None = None
) -> tuple[dict[str, Any], DrafterConfig, dict[str, torch.Tensor]]:
    """Either format as (its config.json, DrafterConfig, canonically named tensors), validated before any tensor is
    loaded; ids converted to ours. Needs no verifier: ``embed_tokens`` is among the tensors only when the file has
    it."""
    config, drafter_config, headers = validate_checkpoint(folder, layer_convention)
    tensors = {
        ("layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k): v
        for k, v in _load(headers).items()
        if not k.startswith(SPECULATORS_EXTRAS)
    }
    _check_maps(tensors, drafter_config.draft_vocab_size, headers["d2t"].path)
    return config, drafter_config, tensors


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
