"""Online features (``train.features: online``): the verifier computes each shard's hidden states while the drafter
trains, and nothing is written to disk.

The shards are extract's own: the same samples in the same plan order, cut into the same shards
(``extract.samples_per_shard``), computed by the same code (``expman.data.extract.shard_computer``: transformers
hooks or the vLLM engine, by ``extract.backend``, in ``extract.dtype``), so a shard holds the bytes the offline shard
would and the batch plan, the resume and the weights are those of an offline run on the same features. The
verifier runs on the training device, in the training process (co-located), and loads on the first shard read.

``OnlineFeatures`` stands where the offline ``ShardReader`` stands: ``read(shard)`` hands out a shard's tensors.
``train.online_cache_gib`` bounds the host memory it keeps computed states in. The held-out documents come first:
they are spread over every shard, so without them validation would compute every shard again after each epoch to
read a tenth of it; ``held_out()`` reads them as training kept them. Whole shards take the rest of the bound (least
recently used dropped first), so later epochs read them instead of computing them again.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from expman.data.extract import online_plan, plan_samples, shard_chunks, shard_computer
from expman.data.generate import read_responses
from expman.errors import ExpmanError
from expman.params import ExtractParams
from expman.training.batches import PER_TOKEN, FeatureReader, SampleRef

__all__ = ["OnlineFeatures", "online_chunks", "online_refs"]


def _bytes(tensors: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _extract_section(manifest: dict[str, Any]) -> ExtractParams:
    """The extract params the manifest was written under (without what the stage resolved and logged beside them)."""
    return ExtractParams(**{k: v for k, v in manifest["params"].items() if k in ExtractParams.model_fields})


def online_chunks(manifest: dict[str, Any], generated: Path) -> list[list[dict[str, Any]]]:
    """The shards' samples, planned again from the responses as extract planned them; refused when the responses
    are not the ones extract recorded the plan of."""
    section = _extract_section(manifest)
    samples = plan_samples(read_responses(generated, section.split), section.max_seq_len)
    if online_plan(samples, section.samples_per_shard) != manifest["plan"]:
        raise ExpmanError(
            f"{generated}: the responses differ from those data/extract/manifest.json planned online features for; "
            "rerun dvc repro extract"
        )
    return shard_chunks(samples, section.samples_per_shard)


def online_refs(chunks: list[list[dict[str, Any]]]) -> list[SampleRef]:
    """Every document of every online shard, as ``index_samples`` lists those of stored shards."""
    return [
        SampleRef(shard, index, sample["id"], len(sample["ids"]))
        for shard, samples in enumerate(chunks)
        for index, sample in enumerate(samples)
    ]


class OnlineFeatures:
    """Each shard's tensors computed by the verifier when read (or taken from the host cache)."""

    def __init__(
        self,
        manifest: dict[str, Any],
        chunks: list[list[dict[str, Any]]],
        verifier: Path,
        device: str,
        cache_gib: float,
        held_out: Sequence[SampleRef] = (),
    ):
        self.chunks = chunks
        section = _extract_section(manifest)
        longest = max(len(sample["ids"]) for samples in chunks for sample in samples)
        self.stack = contextlib.ExitStack()
        self.compute = self.stack.enter_context(
            shard_computer(section, manifest["contract"], verifier, device, longest, keep=True)
        )
        self.cache: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self.cache_limit = int(cache_gib * 2**30)
        self.cache_bytes = 0
        self.held_out_documents: dict[int, list[int]] = {}
        for ref in held_out:
            self.held_out_documents.setdefault(ref.shard, []).append(ref.index)
        self.held: dict[int, dict[str, Any]] = {}
        self.held_bytes = 0
        self.computed_tokens = 0
        self.compute_seconds = 0.0
        # one forward at a time through the capture hooks: on CUDA the training feed's packer thread may compute
        # the next shard while a validation feed reads
        self.lock = threading.Lock()

    def read(self, shard: int) -> Future:
        """A future of the shard's tensors, computed in the calling thread (on CUDA, the feed's packer thread, so
        the forward runs beside the training step, and the states stay on the GPU, where the feed packs them; on
        the CPU, the training thread, which owns the cores)."""
        future: Future = Future()
        try:
            with self.lock:
                future.set_result(self._tensors(shard))
        except BaseException as err:  # raised where the feed asks for the result, as a failed read is
            future.set_exception(err)
        return future

    def _tensors(self, shard: int) -> dict[str, Any]:
        if shard in self.cache:
            self.cache.move_to_end(shard)
            return self.cache[shard]
        started = time.perf_counter()
        tensors, copied = self.compute(self.chunks[shard])
        if copied is not None:  # the states of a GPU forward are complete only after this event
            copied.synchronize()
        self.compute_seconds += time.perf_counter() - started
        self.computed_tokens += int(tensors["input_ids"].numel())
        self._hold(shard, tensors)
        self._keep(shard, tensors)
        return tensors

    def held_out(self) -> FeatureReader:
        """The reader of the validation batches: a shard's held-out documents as they were kept when the shard was
        computed (the shard itself when cached; computed again only when neither is in memory)."""
        return _HeldOut(self)

    def _hold(self, shard: int, tensors: dict[str, Any]) -> None:
        """The shard's held-out documents into host memory, when they fit the bound. The copy keeps the shard's
        indexing: every other document is left with no tokens."""
        documents = self.held_out_documents.get(shard)
        if not documents or shard in self.held:
            return
        offsets = tensors["sample_offsets"].tolist()
        lengths = [0] * (len(offsets) - 1)
        for index in documents:
            lengths[index] = offsets[index + 1] - offsets[index]
        per_token = sum(tensors[name][:1].numel() * tensors[name].element_size() for name in PER_TOKEN)
        size = sum(lengths) * per_token + 8 * len(offsets)  # measured before any copy: none when it cannot fit
        if self.held_bytes + size > self.cache_limit:
            return
        spans = [slice(offsets[index], offsets[index + 1]) for index in sorted(documents)]
        kept = {name: torch.cat([tensors[name][span] for span in spans]).cpu() for name in PER_TOKEN}
        kept["sample_offsets"] = torch.tensor([0, *lengths]).cumsum(0)
        self.held[shard] = kept
        self.held_bytes += size
        while self.cache and self.held_bytes + self.cache_bytes > self.cache_limit:
            self._drop_oldest()

    def _keep(self, shard: int, tensors: dict[str, Any]) -> None:
        """Into the host cache (states computed on a GPU are copied down), in what the held-out documents leave
        of the bound."""
        size = _bytes(tensors)
        if self.held_bytes + size > self.cache_limit:
            return
        self.cache[shard] = {name: tensor.cpu() for name, tensor in tensors.items()}
        self.cache_bytes += size
        while self.held_bytes + self.cache_bytes > self.cache_limit:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        _, dropped = self.cache.popitem(last=False)
        self.cache_bytes -= _bytes(dropped)

    def close(self) -> None:
        self.cache.clear()
        self.held.clear()
        self.stack.close()


class _HeldOut:
    """``OnlineFeatures`` as the validation batches read it (``OnlineFeatures.held_out``)."""

    def __init__(self, features: OnlineFeatures):
        self.features = features

    def read(self, shard: int) -> Future:
        held = self.features.held.get(shard)  # entries are only added (under the lock), never replaced
        if held is None:
            return self.features.read(shard)
        future: Future = Future()
        future.set_result(held)
        return future

    def close(self) -> None:
        """The features it reads are closed by their owner."""
