"""prepare: resolve the verifier (HF folder or GGUF) into an HF safetensors folder and record its contract facts.

This is the one module that talks to the GGUF loader (transformers' ``gguf_file`` + ``GgufConfig``). The
contract facts (architecture, layers, hidden size, vocab, tokenizer and chat-template hashes) are what every
later stage checks its inputs against.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from expman.errors import ExpmanError
from expman.params import Params, resolve_package_file
from expman.provenance import atomic_dir, read_manifest, sha256_file
from expman.registry.tracking import stage_run

__all__ = [
    "GROUPED_SDPA",
    "grouped_sdpa_attention",
    "use_grouped_sdpa",
    "layer_split",
    "load_tokenizer",
    "load_verifier",
    "load_verifier_head",
    "prepare",
    "verifier_facts",
]


def _source_path(source: str, root: Path) -> Path:
    return resolve_package_file(source) if source.startswith("package:") else root / source


def _load_source(path: Path, dtype: Any, trust_remote_code: bool) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    if path.is_file():  # GGUF: dequantize into a dense model save_pretrained can write
        kwargs = {"gguf_file": path.name}
        tokenizer = AutoTokenizer.from_pretrained(path.parent, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, quantization_config=GgufConfig(dequantize=True), dtype=dtype, **kwargs
        )
    else:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, use_safetensors=True, trust_remote_code=trust_remote_code
        )
    return model, tokenizer


def _refuse_remote_code(path: Path, trust_remote_code: bool) -> None:
    """An HF folder that ships its own model or tokenizer code (``auto_map``) loads only with
    ``prepare.trust_remote_code``: without it transformers either refuses in a multi-line message or, for a known
    model type, silently loads its built-in class instead of the folder's."""
    if trust_remote_code or not path.is_dir():
        return
    for name in ("config.json", "tokenizer_config.json"):
        try:
            config = json.loads((path / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):  # missing or unreadable: the loader reports it
            continue
        if isinstance(config, dict) and "auto_map" in config:
            raise ExpmanError(
                f"{path / name}: the folder ships its own code (auto_map); set prepare.trust_remote_code: true "
                "only if you trust it"
            )


def verifier_facts(model_dir: Path) -> dict[str, Any]:
    """The verifier half of the capture contract, read from a prepared HF folder."""
    config = json.loads((model_dir / "config.json").read_text())
    text_config = config.get("text_config", config)
    tokenizer_file = model_dir / "tokenizer.json"
    template_file = model_dir / "chat_template.jinja"
    template = template_file.read_text(encoding="utf-8") if template_file.is_file() else ""
    weights = hashlib.sha256()
    for shard in sorted(model_dir.glob("*.safetensors")):
        weights.update(sha256_file(shard).encode())
    return {
        "architecture": (config.get("architectures") or ["unknown"])[0],
        "model_type": text_config.get("model_type", config.get("model_type")),
        "num_hidden_layers": text_config["num_hidden_layers"],
        "hidden_size": text_config["hidden_size"],
        "vocab_size": text_config["vocab_size"],
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
        "tokenizer_sha256": sha256_file(tokenizer_file) if tokenizer_file.is_file() else "",
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest() if template else "",
        "weights_sha256": weights.hexdigest(),
    }


def prepare(params: Params, out_dir: Path) -> dict[str, Any]:
    """Resolve ``params.prepare.source`` into ``out_dir`` (HF safetensors folder + manifest.json)."""
    import torch

    section = params.prepare
    root = Path.cwd()
    source = _source_path(section.source, root)
    dtype = getattr(torch, section.save_dtype)
    _refuse_remote_code(source, section.trust_remote_code)
    try:  # loaders raise anything from struct.error (torn GGUF) to SafetensorError (torn weights)
        model, tokenizer = _load_source(source, dtype, section.trust_remote_code)
    except Exception as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ExpmanError(f"{source}: cannot load the verifier: {type(err).__name__}: {reason}") from None
    if not tokenizer.chat_template:
        raise ExpmanError(f"{source}: the tokenizer has no chat template; generate needs one")
    with stage_run("prepare", section.model_dump(), upstream={}) as run:
        with atomic_dir(out_dir) as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            facts = verifier_facts(tmp)
            manifest = run.write_manifest(
                tmp / "manifest.json",
                {
                    "source": section.source,
                    "source_sha256": sha256_file(source) if source.is_file() else "",
                    "dtype": section.save_dtype,
                    "trust_remote_code": section.trust_remote_code,
                    "verifier": facts,
                },
            )
        run.log_metrics({"num_hidden_layers": facts["num_hidden_layers"], "hidden_size": facts["hidden_size"]})
    return manifest


def load_verifier_manifest(model_dir: Path) -> dict[str, Any]:
    """The prepare manifest of a verifier folder."""
    return read_manifest(model_dir / "manifest.json", "prepare")


def load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    manifest = load_verifier_manifest(model_dir)
    return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=manifest["trust_remote_code"])


def layer_split(model_dir: Path, gpus: int, trust_remote_code: bool) -> dict[str, int]:
    """A transformers ``device_map`` that spreads the decoder layers evenly over ``gpus`` GPUs, in order: the
    decoder's other modules (embedding, rotary, final norm) on the first, the lm_head on the last (on the first
    when it is tied to the embedding). Built from the model's own module names, on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    decoder = skeleton.get_decoder()
    prefix = next(name for name, module in skeleton.named_modules() if module is decoder)
    count = len(decoder.layers)
    device_map = {f"{prefix}.layers.{i}": i * gpus // count for i in range(count)}
    device_map |= {f"{prefix}.{name}": 0 for name, _ in decoder.named_children() if name != "layers"}
    last = 0 if getattr(config, "tie_word_embeddings", False) else gpus - 1
    device_map |= {name: last for name, _ in skeleton.named_children() if name != prefix.split(".")[0]}
    return device_map


def load_verifier_head(model_dir: Path, device: str, dtype: Any) -> tuple[Any, Any]:
    """The verifier's final norm and lm_head alone, weights read from its safetensors: what turns final states
    into logits where another engine computed the states. The decoder layers are never materialized."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    manifest = load_verifier_manifest(model_dir)
    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=manifest["trust_remote_code"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=manifest["trust_remote_code"], dtype=dtype)
    norm, lm_head = getattr(model.get_decoder(), "norm", None), model.get_output_embeddings()
    if norm is None or lm_head is None:
        raise ExpmanError(f"{model_dir}: {type(model).__name__} has no final norm or lm_head to read")
    names: dict[int, list[str]] = {}  # a tied lm_head is also named as the embedding
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    wanted = {name for module in (norm, lm_head) for p in module.parameters() for name in names[id(p)]}
    found: dict[str, Any] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            found.update({key: handle.get_tensor(key) for key in wanted.intersection(handle.keys())})
    modules = []
    for module in (norm, lm_head):
        candidates = {local: names[id(parameter)] for local, parameter in module.named_parameters()}
        module.to_empty(device=device)  # new parameters, on the device, uninitialized
        for local, keys in candidates.items():
            stored = next((found[key] for key in keys if key in found), None)
            if stored is None:
                raise ExpmanError(f"{model_dir}: no tensor {keys[0]} in its safetensors files")
            with torch.no_grad():
                module.get_parameter(local).copy_(stored)
        modules.append(module.eval())
    return modules[0], modules[1]


GROUPED_SDPA = "expman_grouped_sdpa"
"""The verifier's attention (a transformers attention function) wherever its model class takes one: SDPA that keeps
grouped key/value heads unrepeated under a padding mask (``grouped_sdpa_attention``)."""


def grouped_sdpa_attention(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Any, None]:
    """transformers' SDPA attention, except where grouped-query heads meet a mask (left-padded batches): there
    transformers copies each key/value head for every query head of its group (``repeat_kv``) at every layer and
    step, because torch's masked CUDA kernels take no ``enable_gqa``. Here the query heads of a group are folded into
    the query length instead, and the mask repeated along it: each query row meets the same keys, values, scale and
    mask as before, and the cache is read once per key/value head rather than copied. Anything else (no mask, no
    groups, a paged cache, a position bias, a per-head mask) goes to transformers' own function unchanged."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if (
        groups == 1
        or attention_mask is None
        or attention_mask.dim() != 4
        or attention_mask.shape[1] != 1
        or dropout
        or kwargs.get("cache") is not None
        or kwargs.get("position_bias") is not None
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    batch, heads, length, head_dim = query.shape
    folded = query.reshape(batch, key.shape[1], groups * length, head_dim)  # query head h reads key/value h // groups
    mask = attention_mask.repeat(1, 1, groups, 1)  # row g * length + t of the fold is row t of each head
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, length, -1).transpose(1, 2).contiguous(), None


def use_grouped_sdpa(model: Any) -> None:
    """Switch a loaded model to ``GROUPED_SDPA`` where its class dispatches attention through transformers'
    registry (the library's own model classes); other classes keep plain SDPA."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if not getattr(model, "_supports_attention_backend", False):
        return
    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)  # the same masks as SDPA's
    model.set_attn_implementation(GROUPED_SDPA)


def load_verifier(model_dir: Path, device: str, dtype: Any, gpus: int = 1, grouped_heads: bool = True) -> Any:
    """The prepared verifier in eval mode, safetensors only. With ``gpus`` > 1 its layers are spread over that many
    GPUs (``layer_split``), for a verifier that does not fit one: a forward runs them one GPU after another.
    Its attention is ``GROUPED_SDPA`` unless ``grouped_heads`` is false (transformers' continuous batching accepts
    only its own implementations) or the model is remote code, which may not dispatch through transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    manifest = load_verifier_manifest(model_dir)
    placement: dict[str, Any] = {}
    if gpus > 1:
        visible = torch.cuda.device_count() if device == "cuda" else 0
        if visible < gpus:
            raise ExpmanError(f"extract.gpus: {gpus} GPUs asked for, {visible} visible on device {device!r}")
        placement["device_map"] = layer_split(model_dir, gpus, manifest["trust_remote_code"])
    model = AutoModelForCausalLM.from_pretrained(
        model_dir,
        dtype=dtype,
        use_safetensors=True,
        trust_remote_code=manifest["trust_remote_code"],
        attn_implementation="sdpa",
        **placement,
    )
    if grouped_heads and not manifest["trust_remote_code"]:
        use_grouped_sdpa(model)
    return (model if placement else model.to(device)).eval()
