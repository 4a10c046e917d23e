"""The train stage's data path: the documents of the extract shards, the seeded batch plan, and the feed that reads,
checks and packs shards off the training thread.

On CUDA a packer thread also packs the batches and copies them to the GPU; on the CPU the training thread packs.
Why threads and not DataLoader worker processes: the heavy work of the feed (file reads, sha256, the copies of
``torch.cat`` and the host-to-device copy) runs in C with the GIL released, so threads get the parallelism without
worker processes' second copy of every batch through shared memory; and one process keeps the bit-identical resume
simple: the plan fixes every batch, whatever order the threads finish in.

Memory, stated: at most ``2 x train.shard_window`` shards are resident on the host at a time (the window being
packed and the next one being read; more only if one batch needs more), plus, on CUDA, two pinned staging rows
of ``train.max_tokens`` tokens and at most ``train.prefetch`` packed batches waiting on the device. At the
llama3-8b drafter shape (32 KiB of features a token) with 0.5 GiB shards, window 4 and 8192-token batches: 4 GiB
of shards and 0.5 GiB pinned on the host, 0.75 GiB on the GPU (counting the batch in training); at Kimi-K2's
(56 KiB a token, 0.55 GiB shards): 4.4 GiB, 0.9 GiB and 1.3 GiB. With online features on CUDA the resident
shards are on the GPU instead (the verifier computed them there) and batches are packed there.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from expman.data.extract import TENSORS, load_shard
from expman.data.features import FeatureStore, feature_folder
from expman.drafter.objective import Packed
from expman.errors import ExpmanError

__all__ = ["BatchFeed", "FeatureReader", "SampleRef", "ShardReader", "batch_plan", "index_samples", "split_samples"]

PER_TOKEN = [name for name in TENSORS if name != "sample_offsets"]
"""The shard tensors a packed row is made of (``sample_offsets`` only locates the documents)."""


@dataclass(frozen=True)
class SampleRef:
    """One document inside one extract shard."""

    shard: int
    index: int
    sample_id: str
    length: int


def hash_share(sample_id: str, salt: str = "") -> float:
    """A stable number in [0, 1) per sample id: splits stay the same across runs and machines."""
    digest = hashlib.sha256((salt + sample_id).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def index_samples(manifest: dict[str, Any]) -> list[SampleRef]:
    """Every document of every shard (ids from the shard metadata, lengths from its offsets), no tensor load.

    A shard whose size or plan key differs from its manifest entry (torn, or another run's) is refused here, before
    any training; the full checksum is checked when the shard is read."""
    from safetensors import SafetensorError, safe_open

    refs = []
    folder = feature_folder(manifest)
    for shard, entry in enumerate(manifest["shards"]):
        path = folder / entry["path"]
        if not path.is_file():
            raise ExpmanError(f"{path}: shard listed in the manifest is missing; rerun `dvc repro -f extract`")
        foreign = f"{path}: not the shard the manifest lists (corrupted, or a shard from another run)"
        if path.stat().st_size != entry["bytes"]:
            raise ExpmanError(foreign)
        try:
            with safe_open(str(path), "pt") as handle:
                metadata = json.loads(handle.metadata()["expman"])
                offsets = handle.get_tensor("sample_offsets").tolist()
                tensor_names = set(handle.keys())
        except (SafetensorError, KeyError, TypeError, json.JSONDecodeError):
            raise ExpmanError(foreign) from None
        if "verifier_top1" not in tensor_names:
            raise ExpmanError(f"{path}: no verifier_top1 tensor (from an older expman); rerun `dvc repro -f extract`")
        if metadata.get("key") != entry["key"]:
            raise ExpmanError(foreign)
        ids = metadata["sample_ids"]
        refs.extend(SampleRef(shard, i, sample_id, offsets[i + 1] - offsets[i]) for i, sample_id in enumerate(ids))
    return refs


def split_samples(
    refs: list[SampleRef], val_fraction: float, sample_share: float, group: Any
) -> tuple[list[SampleRef], list[SampleRef]]:
    """(train, validation) by a hash of ``group(sample_id)`` (the prompt: a prompt's sampled copies stay together,
    so validation never sees a trained prompt); training keeps ``sample_share`` of its groups."""
    val = [r for r in refs if hash_share(group(r.sample_id)) < val_fraction]
    train = [
        r
        for r in refs
        if hash_share(group(r.sample_id)) >= val_fraction and hash_share(group(r.sample_id), "share") < sample_share
    ]
    return train, val


def batch_plan(refs: list[SampleRef], max_tokens: int, seed: int, epoch: int, window: int = 1) -> list[list[SampleRef]]:
    """The epoch's batches, a pure function of (seed, epoch): shards in a seeded order, cut into windows of
    ``window`` consecutive shards; the documents of a window shuffled together and packed greedily, so a batch
    mixes documents of up to ``window`` shards (with 1, the same plan as before windows existed)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    by_shard: dict[int, list[SampleRef]] = {}
    for ref in refs:
        by_shard.setdefault(ref.shard, []).append(ref)
    shards = [sorted(by_shard)[i] for i in torch.randperm(len(by_shard), generator=generator).tolist()]
    batches: list[list[SampleRef]] = []
    for start in range(0, len(shards), window):
        documents = [ref for shard in shards[start : start + window] for ref in by_shard[shard]]
        current, used = [], 0
        for ref in [documents[i] for i in torch.randperm(len(documents), generator=generator).tolist()]:
            length = min(ref.length, max_tokens)
            if current and used + length > max_tokens:
                batches.append(current)
                current, used = [], 0
            current.append(ref)
            used += length
        if current:
            batches.append(current)
    return batches


def reader_threads() -> int:
    """Reader threads per training process: half this host's cores, shared by its processes (1 to 8)."""
    per_process = (os.cpu_count() or 2) // (2 * int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, min(8, per_process))


class FeatureReader(Protocol):
    """What the feed reads shards through: ``ShardReader`` (stored shards) or ``OnlineFeatures`` (computed)."""

    def read(self, shard: int) -> Future: ...

    def close(self) -> None: ...


class ShardReader:
    """Reads whole shards on a pool of threads; a shard's sha256 is checked against the manifest on its first read
    in this process, before any of its tensors is handed out."""

    def __init__(self, manifest: dict[str, Any], threads: int | None = None):
        self.manifest = manifest
        self.in_use = FeatureStore.default().using(manifest["features"]["key"])  # gc leaves a set being read
        self.in_use.__enter__()
        self.folder = feature_folder(manifest)
        self.verified: set[int] = set()
        self.pool = ThreadPoolExecutor(threads or reader_threads(), thread_name_prefix="shard-reader")

    def read(self, shard: int) -> Future:
        """A future of the shard's tensors (it raises ExpmanError naming the file if the checksum differs)."""
        return self.pool.submit(self._load, shard)

    def _load(self, shard: int) -> dict[str, torch.Tensor]:
        tensors = load_shard(self.manifest, shard, verify=shard not in self.verified, folder=self.folder)
        self.verified.add(shard)
        return tensors

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.in_use.__exit__(None, None, None)


def _document(tensors: dict[str, torch.Tensor], ref: SampleRef, max_tokens: int) -> dict[str, torch.Tensor]:
    start = int(tensors["sample_offsets"][ref.index])
    end = min(int(tensors["sample_offsets"][ref.index + 1]), start + max_tokens)
    return {name: tensors[name][start:end] for name in PER_TOKEN}


class _Staging:
    """A pinned host row of ``length`` tokens per packed tensor, in the shard dtypes, reused batch after batch; the
    event marks when the device copy out of it has finished (only then is it overwritten)."""

    FILL = {"verifier_top1": -1, "loss_mask": False, "document_ids": -1}

    def __init__(self, example: dict[str, torch.Tensor], length: int):
        shapes = {name: (length, *example[name].shape[1:]) for name in PER_TOKEN}
        self.rows = {name: torch.empty(shapes[name], dtype=example[name].dtype, pin_memory=True) for name in shapes}
        self.rows["document_ids"] = torch.empty(length, dtype=torch.int32, pin_memory=True)
        self.rows["position_ids"] = torch.empty(length, dtype=torch.int32, pin_memory=True)
        self.copied: torch.cuda.Event | None = None

    def pack(self, documents: list[dict[str, torch.Tensor]], length: int) -> dict[str, torch.Tensor]:
        """The documents packed into the first ``length`` tokens (the tail past them padded as ``Packed.padded``)."""
        if self.copied is not None:
            self.copied.synchronize()
        return _fill({name: row[:length] for name, row in self.rows.items()}, documents)


def _fill(rows: dict[str, torch.Tensor], documents: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``rows`` (one per packed tensor, on the host or the device) filled with the documents, then padding."""
    used = sum(len(d["input_ids"]) for d in documents)
    for name in PER_TOKEN:
        torch.cat([d[name] for d in documents], out=rows[name][:used])
    sizes = torch.tensor([len(d["input_ids"]) for d in documents])
    ids = torch.arange(len(documents), dtype=torch.int32).repeat_interleave(sizes)
    rows["document_ids"][:used] = ids
    starts = torch.cumsum(sizes, 0) - sizes
    rows["position_ids"][:used] = torch.arange(used, dtype=torch.int32) - starts.repeat_interleave(sizes)
    for name, row in rows.items():
        row[used:] = _Staging.FILL.get(name, 0)
    return rows


def _packed(rows: dict[str, torch.Tensor]) -> Packed:
    """Packed rows (on the device) as the training step takes them: one batch row, ids and targets as int64."""
    return Packed(
        aux=rows["aux_hidden_states"][None],
        final=rows["final_hidden_states"][None],
        top1=rows["verifier_top1"].long()[None],
        input_ids=rows["input_ids"].long()[None],
        loss_mask=rows["loss_mask"][None],
        document_ids=rows["document_ids"].long()[None],
        position_ids=rows["position_ids"].long()[None],
    )


class BatchFeed:
    """The packed batches of ``plan`` (lists of documents, in order), made on background threads.

    Reader threads read and check the shards in order of first use, at most ``resident`` at a time, each dropped
    after its last batch. On CUDA a packer thread packs each batch into pinned staging rows, copied to the device
    with ``non_blocking`` on a stream of its own, behind the training step, into a queue of ``prefetch``. On the
    CPU the batches are packed as they are asked for: there is no copy to hide, and a second thread calling torch
    ops would compete for the cores the step's own threads use. Iterating yields the batches in plan order; an
    error on a thread (a shard whose checksum differs) is raised here, before any batch of that shard is handed
    out."""

    def __init__(
        self,
        reader: FeatureReader,
        plan: list[list[SampleRef]],
        max_tokens: int,
        device: str,
        pad_to: int | None = None,
        prefetch: int = 2,
        resident: int = 2,
    ):
        self.reader, self.plan, self.max_tokens, self.device, self.pad_to = reader, plan, max_tokens, device, pad_to
        self.resident = resident
        self.cuda_index = torch.cuda.current_device() if device == "cuda" else None
        self.queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self.stopped = threading.Event()
        self.thread = (
            threading.Thread(target=self._produce, name="batch-packer", daemon=True) if device == "cuda" else None
        )
        if self.thread is not None:
            self.thread.start()

    def __iter__(self) -> Iterator[Packed]:
        if self.thread is None:
            for batch, _ in self._batches():
                yield batch
            return
        for _ in self.plan:
            item = self.queue.get()
            if isinstance(item, BaseException):
                self.close()
                raise item
            yield self._received(*item)

    @staticmethod
    def _received(batch: Packed, copied: Any) -> Packed:
        if copied is not None:  # made on the packer's stream: the step's stream waits for it and owns it now
            stream = torch.cuda.current_stream()
            stream.wait_event(copied)
            for name in Packed.__dataclass_fields__:
                getattr(batch, name).record_stream(stream)
        return batch

    def close(self) -> None:
        """Stop the threads (a consumer that leaves early, or an error); queued batches are dropped."""
        self.stopped.set()
        while self.thread is not None and self.thread.is_alive():
            with contextlib.suppress(queue.Empty):
                self.queue.get(timeout=0.05)

    def _put(self, item: Any) -> bool:
        while not self.stopped.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self) -> None:
        try:
            if self.device == "cuda":  # the current device is per thread: the one the training thread chose
                torch.cuda.set_device(self.cuda_index)
            for item in self._batches():
                if not self._put(item):
                    return
        except BaseException as err:  # handed to the training thread, which raises it
            self._put(err)

    def _batches(self) -> Iterator[tuple[Packed, Any]]:
        """Each planned batch and the event marking its device copy (None on the CPU), in plan order."""
        order: list[int] = []
        last_use: dict[int, int] = {}
        for position, refs in enumerate(self.plan):
            for ref in refs:
                if ref.shard not in last_use:
                    order.append(ref.shard)
                last_use[ref.shard] = position
        reads: dict[int, Future] = {}
        ahead = 0  # shards of ``order`` before this one have been asked for
        staging: list[_Staging] = []
        stream = torch.cuda.Stream() if self.device == "cuda" else None
        for position, refs in enumerate(self.plan):
            for shard in [ref.shard for ref in refs if ref.shard not in reads]:  # needed now, whatever the bound
                reads[shard] = self.reader.read(shard)
            while ahead < len(order) and len(reads) < self.resident:
                if order[ahead] not in reads and last_use[order[ahead]] >= position:
                    reads[order[ahead]] = self.reader.read(order[ahead])
                ahead += 1
            documents = [_document(reads[ref.shard].result(), ref, self.max_tokens) for ref in refs]
            if stream is None:
                batch = Packed.of(documents)
                item = (batch.padded(self.pad_to) if self.pad_to else batch), None
            elif any(d["aux_hidden_states"].is_cuda for d in documents):
                item = self._on_device(documents), None
            else:
                if not staging:
                    staging = [_Staging(documents[0], self.pad_to or self.max_tokens) for _ in range(2)]
                item = self._to_device(staging[position % 2], documents, stream)
            for shard in {ref.shard for ref in refs}:
                if last_use[shard] == position:
                    del reads[shard]
            yield item

    def _to_device(self, staging: _Staging, documents: list[dict[str, torch.Tensor]], stream: Any) -> tuple:
        """The batch on the device, copied out of ``staging`` on ``stream``, and the event that marks the copy."""
        length = self.pad_to or sum(len(d["input_ids"]) for d in documents)
        rows = staging.pack(documents, length)
        with torch.cuda.stream(stream):
            batch = _packed({name: row.to(self.device, non_blocking=True) for name, row in rows.items()})
            staging.copied = torch.cuda.Event()
            staging.copied.record(stream)
        return batch, staging.copied

    def _on_device(self, documents: list[dict[str, torch.Tensor]]) -> Packed:
        """Documents whose states are on the GPU already (online features) packed there, on this thread's stream
        (the one the states were computed on): no host round trip. Documents read from the host (a cached online
        shard beside a fresh one) are copied up first."""
        length = self.pad_to or sum(len(d["input_ids"]) for d in documents)
        documents = [{name: d[name].to(self.device, non_blocking=True) for name in PER_TOKEN} for d in documents]
        example = documents[0]
        rows = {
            name: torch.empty((length, *example[name].shape[1:]), dtype=example[name].dtype, device=self.device)
            for name in PER_TOKEN
        }
        for name in ("document_ids", "position_ids"):
            rows[name] = torch.empty(length, dtype=torch.int32, device=self.device)
        return _packed(_fill(rows, documents))
