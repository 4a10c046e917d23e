"""extract: capture the verifier's aux hidden states, final hidden state and greedy next token per token into
safetensors shards.

Layer ids follow the HF ``hidden_states`` convention (0 = embeddings, i = output of decoder layer i-1), which
equals vLLM/speculators aux ids. The final state is the last decoder layer's output before the final norm
(``pre_norm``, so targets are ``lm_head(norm(h))``) or after it (``post_norm``); the contract records which.
The verifier's top-1 token is computed here, once, by its own lm_head (in chunks of tokens, never the whole
[T, vocab] logits): training needs it only to mask positions whose target lies outside the draft vocab, and
computing it there would repeat a full-vocab matmul at every step of every epoch. The shards go to the feature
store (``expman.data.features``) under a key of what determines them; a published key is read, not computed again.
Shards are resumable: after a kill, completed shards are kept and the partial one is redone. Git tracks
``manifest.json`` (the key, per-shard size and sha256), never the shards.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from expman.data.features import STORE_VARIABLE, FeatureStore, feature_folder, feature_key
from expman.data.generate import read_responses
from expman.data.shards import ShardSet, disk_room, readable_size, remove_stale_temps, verify_shard
from expman.errors import ExpmanError
from expman.params import ExtractParams, Params
from expman.paths import ExtractPaths
from expman.provenance import read_manifest, sha256_json, upstream_entry
from expman.registry.tracking import StageRun, stage_run

__all__ = [
    "CaptureHooks",
    "capture_contract",
    "default_aux_layers",
    "engine_shard",
    "extract",
    "extract_shard",
    "greedy_tokens",
    "load_shard",
    "online_plan",
    "plan_samples",
    "planned_key",
    "save_streamed",
    "shard_chunks",
    "shard_computer",
    "write_shards",
]

SHARD_WRITERS = 2  # shards being written while the next one computes
LAYER_CONVENTION = "hf_hidden_states"  # 0 = embeddings, i = output of decoder layer i-1 (= vLLM/speculators ids)
TENSORS = {
    "input_ids": "[T] int32",
    "loss_mask": "[T] bool, true on assistant (generated) tokens",
    "aux_hidden_states": "[T, 3*H] bfloat16, the aux layers concatenated in aux_layers order",
    "final_hidden_states": "[T, H] bfloat16, the final_state of the last decoder layer",
    "verifier_top1": "[T] int32, the verifier's greedy next token at each position (argmax of its logits)",
    "sample_offsets": "[n+1] int64, sample k spans rows offsets[k]:offsets[k+1]",
}


STATE_BYTES = 2  # the aux and final states are stored in bf16 whatever the compute dtype
TOKEN_BYTES = 4 + 1 + 4  # input_ids int32 + loss_mask bool + verifier_top1 int32


def bytes_per_token(hidden_size: int) -> int:
    """What a shard stores per token: the three aux states and the final state, the token, its mask and top-1."""
    return 4 * hidden_size * STATE_BYTES + TOKEN_BYTES


def default_aux_layers(num_layers: int) -> list[int]:
    """The vLLM/speculators default: [2, N//2, N-3] in HF hidden_states ids."""
    return [2, num_layers // 2, num_layers - 3]


def capture_contract(verifier: dict[str, Any], section: ExtractParams) -> dict[str, Any]:
    """What a consumer of these features must agree with: verifier facts, layer ids and convention, final state."""
    num_layers = verifier["num_hidden_layers"]
    aux = default_aux_layers(num_layers) if section.aux_layers == "auto" else list(section.aux_layers)
    if max(aux) > num_layers - 1:
        raise ExpmanError(
            f"extract.aux_layers: {aux} exceeds {num_layers - 1}, the last id whose state is a layer output "
            f"before the final norm (the verifier has {num_layers} layers)"
        )
    return {
        "verifier": verifier,
        "aux_layers": aux,
        "layer_convention": LAYER_CONVENTION,
        "final_state": section.final_state,
        "final_layer": num_layers,
        "dtype": "bfloat16",
        "max_seq_len": section.max_seq_len,
        "tensors": TENSORS,
    }


LOGIT_CHUNK_TOKENS = 4096  # full-vocab logits exist for this many tokens at a time (128K-vocab bf16: 1 GiB)


def greedy_tokens(lm_head: Any, normed: Any) -> Any:
    """The verifier's greedy next token [...] from its post-norm states [..., H]: its own lm_head's argmax, run on
    ``LOGIT_CHUNK_TOKENS`` tokens at a time so the full-vocab logits never exist for the whole batch."""
    import torch

    flat = normed.reshape(-1, normed.shape[-1])
    top1 = torch.cat([lm_head(part).argmax(-1) for part in flat.split(LOGIT_CHUNK_TOKENS)])
    return top1.view(normed.shape[:-1])


class CaptureHooks:
    """Forward hooks that keep the aux layer outputs and the final (pre- or post-norm) state of one forward, and
    the verifier's top-1 from its own lm_head."""

    def __init__(self, model: Any, aux_layers: list[int], final_state: str):
        self.base = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        layers = self.base.layers
        self.aux_layers = aux_layers
        self.final_state = final_state
        self.states: dict[Any, Any] = {}
        modules = {i: (self.base.embed_tokens if i == 0 else layers[i - 1]) for i in aux_layers}
        if final_state == "pre_norm":
            modules["final"] = layers[-1]
        self.handles = [m.register_forward_hook(self._keep(key)) for key, m in modules.items()]

    def _keep(self, key: Any) -> Any:
        def hook(_module: Any, _inputs: Any, output: Any) -> None:
            self.states[key] = output[0] if isinstance(output, tuple) else output

        return hook

    def __call__(self, input_ids: Any, attention_mask: Any) -> tuple[Any, Any, Any]:
        """Run the decoder stack and the lm_head; return (aux [B, T, 3H], final [B, T, H], top-1 [B, T] int32),
        all on the device of the last hidden state (a verifier spread over GPUs keeps states on several)."""
        import torch

        self.states.clear()
        out = self.base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        normed = out.last_hidden_state
        device = normed.device
        final = self.states["final"].to(device) if self.final_state == "pre_norm" else normed
        aux = torch.cat([self.states[i].to(device) for i in self.aux_layers], dim=-1)
        return aux, final, greedy_tokens(self.lm_head, normed).to(device, torch.int32)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Group consecutive samples (sorted longest first) so that rows × padded length <= batch_tokens."""
    batches: list[list[int]] = []
    for index in range(len(lengths)):
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens:
            batches[-1].append(index)
        else:
            batches.append([index])
    return batches


def extract_shard(
    capture: CaptureHooks, samples: list[dict[str, Any]], section: ExtractParams, device: str, keep: bool = False
) -> tuple:
    """Run the verifier over one shard's samples; return its tensors and, on CUDA, the event after which their
    copies are complete (None on CPU).

    On CUDA the states go straight from each batch's valid rows into one pinned host tensor per shard, by
    asynchronous copies queued behind the forward: the GPU never waits for the host, and the host never blocks on
    the GPU, so the next batch (and the next shard) computes while earlier ones are copied and written. With
    ``keep`` (online features, which train on them) they stay on ``device`` instead, token ids and loss mask too:
    no round trip through the host."""
    import torch

    lengths = [len(s["ids"]) for s in samples]
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    on_gpu = torch.device(device).type == "cuda"
    hidden = capture.base.config.hidden_size
    held = {"device": device} if keep and on_gpu else {"pin_memory": on_gpu}
    aux_host = torch.empty((int(offsets[-1]), len(capture.aux_layers) * hidden), dtype=torch.bfloat16, **held)
    final_host = torch.empty((int(offsets[-1]), hidden), dtype=torch.bfloat16, **held)
    top1_host = torch.empty(int(offsets[-1]), dtype=torch.int32, **held)
    for batch in _batches(lengths, section.batch_tokens):
        width = lengths[batch[0]]
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, k in enumerate(batch):
            ids[r, : lengths[k]] = torch.tensor(samples[k]["ids"])
            mask[r, : lengths[k]] = 1
        with torch.inference_mode():
            aux, final, top1 = capture(ids.to(device), mask.to(device))
            for r, k in enumerate(batch):  # rows are padded at the end: each sample is a prefix of its row
                rows = slice(int(offsets[k]), int(offsets[k + 1]))
                aux_host[rows].copy_(aux[r, : lengths[k]], non_blocking=on_gpu)
                final_host[rows].copy_(final[r, : lengths[k]], non_blocking=on_gpu)
                top1_host[rows].copy_(top1[r, : lengths[k]], non_blocking=on_gpu)
    copied = None
    if on_gpu:  # the copies were queued on the stream of the device the states are on
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(aux.device))
    tokens = _token_tensors(samples, offsets)
    if keep and on_gpu:  # sample_offsets stays on the host: the feed reads document bounds from it
        tokens |= {name: tokens[name].to(device) for name in ("input_ids", "loss_mask")}
    tensors = {
        **tokens,
        "aux_hidden_states": aux_host,
        "final_hidden_states": final_host,
        "verifier_top1": top1_host,
    }
    return tensors, copied


def _token_tensors(samples: list[dict[str, Any]], offsets: Any) -> dict[str, Any]:
    """A shard's tensors that depend on the samples alone, whichever backend computed its states: token ids, the
    loss mask (true on response tokens) and the sample offsets."""
    import torch

    loss_mask = torch.zeros(int(offsets[-1]), dtype=torch.bool)
    for k, sample in enumerate(samples):
        loss_mask[int(offsets[k]) + sample["prompt_tokens"] : int(offsets[k + 1])] = True
    return {
        "input_ids": torch.tensor([t for s in samples for t in s["ids"]], dtype=torch.int32),
        "loss_mask": loss_mask,
        "sample_offsets": offsets.to(torch.int64),
    }


# the dtypes extract writes, in the order safetensors lays tensors out (its dtype order, widest kinds first)
SAFETENSORS_DTYPES = {"int64": "I64", "float32": "F32", "int32": "I32", "bfloat16": "BF16", "bool": "BOOL"}


WRITE_BLOCK = 64 << 20  # bytes per write and hash call: large enough to amortize the calls, small enough to overlap


def save_streamed(tensors: dict[str, Any], path: Path, metadata: dict[str, str]) -> str:
    """Write ``tensors`` (CPU, contiguous) as a safetensors file straight from their memory, hashing the bytes as
    they go out; return the file's sha256.

    Why not ``safetensors.torch.save_file``: it first copies every tensor into a Python bytes object with the GIL
    held (2 GiB per shard of an 8B verifier) and the file then has to be read back to be hashed, so the thread
    launching the verifier's kernels stalls and the GPU idles. Here each write and hash call gets a view of the
    tensor's memory and releases the GIL. The layout is the format's own (8-byte header length, JSON header padded
    to 8 bytes, tensors back to back, in its order): the file is byte for byte what ``save_file`` writes.

    The hash runs in a helper thread, block by block in file order, while this thread writes the blocks: sha256
    (about 1.3 GB/s on one core) and the write then overlap instead of adding up."""
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    import torch

    header: dict[str, Any] = {"__metadata__": metadata}
    views, offset = [], 0
    order = list(SAFETENSORS_DTYPES)
    kinds = {name: str(tensor.dtype).removeprefix("torch.") for name, tensor in tensors.items()}
    for name in sorted(tensors, key=lambda name: (order.index(kinds[name]), name)):  # as save_file orders them
        tensor = tensors[name]
        view = memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
        dtype = SAFETENSORS_DTYPES[kinds[name]]
        header[name] = {"dtype": dtype, "shape": list(tensor.shape), "data_offsets": [offset, offset + view.nbytes]}
        views.append(view)
        offset += view.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    blocks = [len(encoded).to_bytes(8, "little"), encoded]
    blocks += [view[start : start + WRITE_BLOCK] for view in views for start in range(0, view.nbytes, WRITE_BLOCK)]
    digest = hashlib.sha256()
    with ThreadPoolExecutor(1, thread_name_prefix="shard-hash") as hasher, open(path, "wb") as handle:
        hashed = [hasher.submit(digest.update, block) for block in blocks]  # one worker: in order
        for block in blocks:
            handle.write(block)
        for future in hashed:
            future.result()
    return digest.hexdigest()


def shard_chunks(samples: list[dict[str, Any]], samples_per_shard: int) -> list[list[dict[str, Any]]]:
    """The planned samples cut into shards, in plan order: the grouping both extract and online features use."""
    return [samples[start : start + samples_per_shard] for start in range(0, len(samples), samples_per_shard)]


def write_shards(
    compute: Callable[[list[dict[str, Any]]], tuple[dict[str, Any], Any]],
    samples: list[dict[str, Any]],
    section: ExtractParams,
    contract: dict[str, Any],
    shards: ShardSet,
    device: str,
    progress: Callable[[int], None] = lambda tokens: None,
) -> tuple[list[dict[str, Any]], int]:
    """Compute and write every planned shard that is not already done; return (entries in plan order, tokens
    computed). ``compute`` (a shard's samples -> its tensors and the event their host copies wait on, or None) is
    called only when a shard needs computing, so a finished folder loads no model.

    Writing (safetensors file hashed as it streams out, fsync) runs in background threads, at most
    ``SHARD_WRITERS`` shards at a time, while the next shard computes: host memory stays bounded and a GPU
    verifier is held back by the disk only when the disk is the slower of the two. A kill loses only the shards
    in flight; their temp files are removed on the next run."""
    from concurrent.futures import Future, ThreadPoolExecutor

    chunks = shard_chunks(samples, section.samples_per_shard)
    entries: list[dict[str, Any]] = [{} for _ in chunks]
    in_flight: list[tuple[int, Future]] = []
    computed = 0

    def write(name: str, key: str, tensors: dict, copied: Any, metadata: dict, count: int) -> dict[str, Any]:
        if copied is not None:
            copied.synchronize()
        return shards.write(
            name,
            key,
            lambda tmp: save_streamed(tensors, tmp, metadata),
            samples=count,
            tokens=int(tensors["input_ids"].numel()),
            loss_tokens=int(tensors["loss_mask"].sum()),
        )

    with ThreadPoolExecutor(SHARD_WRITERS, thread_name_prefix="shard-writer") as writers:
        for index, chunk in enumerate(chunks):
            name = f"shard-{index:05d}.safetensors"
            key = sha256_json({"contract": contract, "samples": chunk, **_compute_key(section, device)})
            done = shards.done(name, key)
            if done is not None:
                entries[index] = done
            else:
                tensors, copied = compute(chunk)
                # one metadata key: safetensors writes the metadata map in no fixed order
                metadata = {"expman": json.dumps({"key": key, "sample_ids": [s["id"] for s in chunk]})}
                if len(in_flight) == SHARD_WRITERS:
                    finished, future = in_flight.pop(0)
                    entries[finished] = future.result()
                in_flight.append((index, writers.submit(write, name, key, tensors, copied, metadata, len(chunk))))
                computed += int(tensors["input_ids"].numel())
            progress(sum(len(s["ids"]) for s in chunk))
        for finished, future in in_flight:
            entries[finished] = future.result()
    return entries, computed


def _compute_key(section: ExtractParams, device: str) -> dict[str, str]:
    """What else a shard's key depends on: the engine and the compute dtype that produced it (nothing for the hf
    backend in float32, so those keys, and the shards already on disk, stay valid)."""
    from expman.devices import dtype_name

    dtype = dtype_name(section.dtype, device)
    return ({} if section.backend == "hf" else {"backend": section.backend}) | (
        {} if dtype == "float32" else {"dtype": dtype}
    )


def engine_shard(engine: Any, head: tuple[Any, Any], samples: list[dict[str, Any]], final_state: str) -> tuple:
    """One shard's tensors from an engine's states (``VllmHiddenStates``: the aux ids then the final id N, before
    the final norm); the top-1 (and a post-norm final state) come from the verifier's own norm and lm_head."""
    import torch

    norm, lm_head = head
    states = engine.states([s["ids"] for s in samples])
    flat = torch.cat(states)
    dtype = next(lm_head.parameters()).dtype
    with torch.inference_mode():
        normed = torch.cat([norm(part.to(norm.weight.device, dtype)) for part in flat[:, -1].split(LOGIT_CHUNK_TOKENS)])
        top1 = greedy_tokens(lm_head, normed).to("cpu", torch.int32)
    final = flat[:, -1] if final_state == "pre_norm" else normed.cpu()
    tensors = {
        **_token_tensors(samples, torch.tensor([0, *[len(s["ids"]) for s in samples]]).cumsum(0)),
        "aux_hidden_states": flat[:, :-1].flatten(1).to(torch.bfloat16),
        "final_hidden_states": final.to(torch.bfloat16).contiguous(),
        "verifier_top1": top1,
    }
    return tensors, None


def plan_samples(records: list[dict[str, Any]], max_seq_len: int) -> list[dict[str, Any]]:
    """Samples in a fixed order (longest first, then id) so shard contents never depend on timing."""
    samples = [
        {
            "id": r["id"],
            "ids": r["input_ids"][:max_seq_len],
            "prompt_tokens": r["prompt_tokens"],
            "truncated": len(r["input_ids"]) > max_seq_len,
        }
        for r in records
        if r["prompt_tokens"] < max_seq_len
    ]
    return sorted(samples, key=lambda s: (-len(s["ids"]), s["id"]))


def _read_inputs(section: ExtractParams, where: ExtractPaths) -> tuple[dict, list[dict], list[dict], dict]:
    """The capture contract, the responses, the planned samples and the upstream entries."""
    verifier_manifest = read_manifest(where.verifier / "manifest.json", "prepare")
    generated_manifest = read_manifest(where.generated / "manifest.json", "generate")
    if generated_manifest["verifier"] != verifier_manifest["verifier"]:
        raise ExpmanError(f"{where.generated / 'manifest.json'}: responses come from another verifier; rerun generate")
    contract = capture_contract(verifier_manifest["verifier"], section)
    records = read_responses(where.generated, section.split)
    samples = plan_samples(records, section.max_seq_len)
    if not samples:
        raise ExpmanError(f"{where.generated / 'manifest.json'}: no usable {section.split!r} responses to extract")
    upstream = {
        "prepare": upstream_entry(where.verifier / "manifest.json"),
        "generate": upstream_entry(where.generated / "manifest.json"),
    }
    return contract, records, samples, upstream


def check_room(folder: Path, tokens: int, hidden_size: int) -> None:
    """Refuse before the verifier loads when the shards cannot fit on the disk that holds the set's ``folder`` in
    the feature store; shards already there count as written (a resumed extract keeps its own)."""
    free, existing = disk_room(folder)
    needed = tokens * bytes_per_token(hidden_size) - existing
    if needed > free:
        raise ExpmanError(
            f"{STORE_VARIABLE}: the feature store {folder.parent} has {readable_size(free)} free, the shards need "
            f"about {readable_size(needed)} ({tokens:,} tokens × {bytes_per_token(hidden_size):,} B); point "
            f"{STORE_VARIABLE} at a larger disk, or free the store: expman features gc"
        )


def _totals(entries: list[dict], samples: list[dict], records: list[dict], hidden_size: int) -> tuple[dict, dict]:
    """The manifest's totals (samples, tokens, what was cut or skipped) and its storage report."""
    tokens = sum(e["tokens"] for e in entries)
    stored = sum(e["bytes"] for e in entries)
    storage = {
        "bytes": stored,
        "bytes_per_token": stored / tokens,
        "hidden_bytes_per_token": 4 * hidden_size * STATE_BYTES,
        "ratio_to_hidden": stored / tokens / (4 * hidden_size * STATE_BYTES),
    }
    totals = {
        "samples": len(samples),
        "tokens": tokens,
        "loss_tokens": sum(e["loss_tokens"] for e in entries),
        "truncated": sum(s["truncated"] for s in samples),
        "skipped_prompt_too_long": len(records) - len(samples),
    }
    return totals, storage


@contextlib.contextmanager
def shard_computer(
    section: ExtractParams, contract: dict[str, Any], verifier: Path, device: str, longest: int, keep: bool = False
) -> Iterator:
    """A shard's samples -> its tensors, by ``extract.backend``; the verifier (or engine) loads on the first shard
    that needs computing and is released when the stage ends. ``longest``: the most tokens of any sample. ``keep``:
    the hooks' states stay on the GPU (online features; the engine hands its states to the host either way)."""
    from expman.data.verifier import load_verifier, load_verifier_head, load_verifier_manifest
    from expman.devices import resolve_dtype

    dtype = resolve_dtype(section.dtype, device)
    loaded: list[Any] = []

    def with_hooks(chunk: list[dict[str, Any]]) -> tuple:
        if not loaded:
            model = load_verifier(verifier, device, dtype, section.gpus)
            loaded.append(CaptureHooks(model, contract["aux_layers"], section.final_state))
        return extract_shard(loaded[0], chunk, section, device, keep)

    def with_engine(chunk: list[dict[str, Any]]) -> tuple:
        from expman.engines.vllm import VllmHiddenStates

        if not loaded:
            head = load_verifier_head(verifier, device, dtype)
            engine = VllmHiddenStates(
                verifier,
                [*contract["aux_layers"], contract["final_layer"]],
                device,
                str(dtype).removeprefix("torch."),
                section.tensor_parallel_size,
                load_verifier_manifest(verifier)["trust_remote_code"],
                longest,
                section.expert_parallel,
            )
            loaded.extend([engine, head])
        return engine_shard(loaded[0], loaded[1], chunk, section.final_state)

    try:
        yield with_hooks if section.backend == "hf" else with_engine
    finally:
        if loaded and section.backend == "vllm":
            loaded[0].close()


def _engine_version(section: ExtractParams) -> str:
    from importlib import metadata

    if section.backend == "vllm":
        from expman.engines.vllm import vllm_version

        return vllm_version() or "vllm"
    return f"transformers {metadata.version('transformers')}"


def extract(params: Params, where: ExtractPaths) -> dict[str, Any]:
    """Publish the features of ``where.generated`` in the feature store (unless their key is published already) and
    write ``where.out/manifest.json``, which names the key and each shard's checksum."""
    from expman.devices import precision_facts, resolve_device

    section = params.extract
    contract, records, samples, upstream = _read_inputs(section, where)
    device = resolve_device(section.device)
    precision = precision_facts(device, section.dtype)
    if params.train.features == "online":
        return _record_online(section, contract, records, samples, upstream, precision, where)
    key = _set_key(section, contract, upstream, device, precision["dtype"])
    store = FeatureStore.default()
    with store.using(key):
        published = store.published(key)
        if published is None:
            tokens = sum(len(s["ids"]) for s in samples)
            check_room(store.partial_folder(key), tokens, contract["verifier"]["hidden_size"])
        with stage_run("extract", section.model_dump() | {"resolved": precision}, upstream) as run:
            if published is None:
                published = _compute_set(section, contract, where, device, samples, store, key, run)
            else:
                run.log_metrics({"features_reused": 1})
            entries = published["shards"]
            totals, storage = _totals(entries, samples, records, contract["verifier"]["hidden_size"])
            run.log_metrics({**totals, **{f"storage.{k}": v for k, v in storage.items()}})
            facts = {
                "contract": contract,
                "contract_sha256": sha256_json(contract),
                "split": section.split,
                "backend": section.backend,
                "engine": published["engine"],
                "precision": precision,
                "features": {"key": key},
                "shards": entries,
                "totals": totals,
                "storage": storage,
            }
            remove_stale_temps(where.out / "manifest.json")  # left by a kill during an earlier write
            return run.write_manifest(where.out / "manifest.json", facts)


def online_plan(samples: list[dict[str, Any]], samples_per_shard: int) -> dict[str, Any]:
    """What fixes the online shards: how many, of how many samples, and a digest of the samples' ids and lengths in
    plan order (the train stage plans again from the responses and must arrive at the same)."""
    return {
        "shards": len(shard_chunks(samples, samples_per_shard)),
        "samples_per_shard": samples_per_shard,
        "samples_sha256": sha256_json([[s["id"], len(s["ids"]), s["prompt_tokens"]] for s in samples]),
    }


def _record_online(
    section: ExtractParams,
    contract: dict[str, Any],
    records: list[dict],
    samples: list[dict],
    upstream: dict[str, Any],
    precision: dict[str, Any],
    where: ExtractPaths,
) -> dict[str, Any]:
    """``train.features: online``: no feature is computed or stored here. The manifest records the capture contract
    and the shard plan from which the train and baseline stages compute each shard's states while they train."""
    totals = {
        "samples": len(samples),
        "tokens": sum(len(s["ids"]) for s in samples),
        "loss_tokens": sum(len(s["ids"]) - s["prompt_tokens"] for s in samples),
        "truncated": sum(s["truncated"] for s in samples),
        "skipped_prompt_too_long": len(records) - len(samples),
    }
    logged = section.model_dump() | {"resolved": precision, "features": "online"}
    with stage_run("extract", logged, upstream) as run:
        run.log_metrics({**totals, "storage.bytes": 0})
        facts = {
            "contract": contract,
            "contract_sha256": sha256_json(contract),
            "split": section.split,
            "backend": section.backend,
            "engine": _engine_version(section),
            "precision": precision,
            "features": {"mode": "online"},
            "plan": online_plan(samples, section.samples_per_shard),
            "totals": totals,
            "storage": {"bytes": 0},
        }
        remove_stale_temps(where.out / "manifest.json")
        return run.write_manifest(where.out / "manifest.json", facts)


def planned_key(params: Params, where: ExtractPaths) -> str:
    """The feature key extract would publish for these params and inputs (manifests and responses read, no model
    loaded): what ``expman doctor`` looks for in the store."""
    from expman.devices import precision_facts, resolve_device

    section = params.extract
    contract, _, _, upstream = _read_inputs(section, where)
    device = resolve_device(section.device)
    return _set_key(section, contract, upstream, device, precision_facts(device, section.dtype)["dtype"])


def _set_key(section: ExtractParams, contract: dict, upstream: dict, device: str, dtype: str) -> str:
    """The feature set's key: the contract, the inputs, and the extract params with device and dtype resolved."""
    return feature_key(contract, upstream, section.model_dump() | {"device": device, "dtype": dtype})


def _compute_set(
    section: ExtractParams,
    contract: dict[str, Any],
    where: ExtractPaths,
    device: str,
    samples: list[dict],
    store: FeatureStore,
    key: str,
    run: StageRun,
) -> dict[str, Any]:
    """Compute the set ``key`` (resuming its partial folder) and publish it; its set.json. When another process
    published it while this one waited for the key, that one's is returned and nothing is computed."""
    from tqdm import tqdm

    with store.writing(key) as shards:
        if shards is None:
            run.log_metrics({"features_reused": 1})
            return store.published(key)
        total_tokens = sum(len(s["ids"]) for s in samples)
        longest = max(len(s["ids"]) for s in samples)
        with shard_computer(section, contract, where.verifier, device, longest) as compute:
            started = time.perf_counter()
            with tqdm(total=total_tokens, desc=f"extract ({section.backend})", unit="tok", unit_scale=True) as bar:
                entries, computed_tokens = write_shards(compute, samples, section, contract, shards, device, bar.update)
            elapsed = time.perf_counter() - started
        shards.remove_others({e["path"] for e in entries})
        if computed_tokens:
            rate = computed_tokens / elapsed
            run.log_metrics({"extract_tok_per_s": rate, "features_computed_tokens": computed_tokens})
        facts = {
            "contract": contract,
            "verifier": read_manifest(where.verifier / "manifest.json", "prepare")["source"],
            "engine": _engine_version(section),
            "tokens": sum(e["tokens"] for e in entries),
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "shards": entries,
        }
        store.publish(key, shards, facts)
        return {"key": key, **facts}


def load_shard(manifest: dict[str, Any], index: int, verify: bool = True, folder: Path | None = None) -> dict[str, Any]:
    """Tensors of one shard listed in an extract manifest, checksum-verified first. ``folder``: the set's folder when
    the caller resolved it already (a reader of many shards resolves it once)."""
    from safetensors.torch import load_file

    entry = manifest["shards"][index]
    folder = folder or feature_folder(manifest)
    path = verify_shard(folder, entry) if verify else folder / entry["path"]
    return load_file(str(path))
