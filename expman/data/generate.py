"""generate: regenerate assistant responses with the verifier and its own chat template, in resumable shards.

Training a drafter on the verifier's own outputs (not the dataset's) is what makes its acceptance transfer
to serving. Each record keeps the exact token ids the verifier produced (prompt ids from the chat template
plus generated ids up to and including EOS), so extract never re-tokenizes text. With several user turns the
assistant turns are regenerated in order; the last one is the training target.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
import zlib
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from expman.data.conversations import Conversation, read_dataset
from expman.data.shards import ShardSet, verify_shard
from expman.devices import attention_kernels, precision_facts, resolve_device, resolve_dtype
from expman.engines.generation import Backend, GenOutput, Messages
from expman.errors import ExpmanError
from expman.params import GenerateParams, Params
from expman.paths import GeneratePaths
from expman.provenance import read_manifest, sha256_json, upstream_entry
from expman.registry.tracking import stage_run

__all__ = ["generate", "read_responses"]

SHARD_COUNTS = ("records", "failed", "prompt_tokens", "response_tokens")
NOT_IN_SETTINGS = frozenset(
    (
        "datasets",
        "self_prompts",
        "shard_size",
        "batch_size",
        "hf_batching",
        "cudnn_attention",
        "device",
        "tensor_parallel_size",
    )
)
"""generate keys left out of a shard's settings: datasets and self prompts are keyed by themselves; the others change
how responses are computed, not what they are, so shards made under other values stay valid."""


class HFBackend:
    """Generation with transformers on the verifier's device: continuous batching (paged KV cache) or left-padded
    batches through ``generate`` (``generate.hf_batching``)."""

    def __init__(self, model_dir: Path, params: GenerateParams):
        from expman.data.verifier import load_tokenizer, load_verifier

        self.params = params
        self.device = resolve_device(params.device)
        self.continuous = params.hf_batching == "continuous"
        if self.continuous and self.device == "cpu":
            _check_cpu_continuous_batching()
        self.tokenizer = load_tokenizer(model_dir)
        self.tokenizer.padding_side = "left"
        dtype = resolve_dtype(params.dtype, self.device)
        self.model = load_verifier(model_dir, self.device, dtype, grouped_heads=not self.continuous)
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) | {self.tokenizer.eos_token_id}
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.batch_size = params.batch_size  # halved for the rest of the stage where the GPU runs out of memory

    def _prompt_ids(self, messages: Messages) -> list[int]:
        encoded = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True, **self.params.chat_template_kwargs
        )
        return list(encoded["input_ids"])

    def close(self) -> None:
        """Nothing to stop: the model is plain tensors in this process."""

    def generate(self, batch: Sequence[Messages], temperature: float, seeds: Sequence[int]) -> list[GenOutput]:
        """Sampling draws from torch's global generator, which generate seeds once per shard."""
        prompts = [self._prompt_ids(m) for m in batch]
        return self.complete(prompts, temperature, seeds, self.params.max_new_tokens)

    def complete(
        self, prompts: Sequence[list[int]], temperature: float, seeds: Sequence[int], max_new_tokens: int
    ) -> list[GenOutput]:
        """Continue each token-id prompt up to its end of turn; sampling draws from torch's global generator."""
        if not prompts:
            return []
        if self.continuous:
            replies = self._continuous(prompts, temperature, max_new_tokens)
        else:
            replies = self._padded(prompts, temperature, max_new_tokens)
        return [self._output(prompt, reply) for prompt, reply in zip(prompts, replies, strict=True)]

    def _sampling(self, temperature: float, max_new_tokens: int) -> Any:
        """The verifier's generation config (its top-k/top-p defaults) at ``temperature``, stopping at any EOS."""
        config = copy.deepcopy(self.model.generation_config)
        sampling = {"do_sample": True, "temperature": temperature} if temperature else {"do_sample": False}
        config.update(max_new_tokens=max_new_tokens, eos_token_id=sorted(self.eos_ids), pad_token_id=self.pad_id)
        config.update(**sampling)
        return config

    def _padded(self, prompts: Sequence[list[int]], temperature: float, max_new_tokens: int) -> list[list[int]]:
        """Batches of ``batch_size`` prompts of like length, left-padded; a row's tokens after its EOS are padding.
        A batch the GPU has no memory for is retried at half the size, which the rest of the stage keeps (the
        random state put back first, so the replies are those of a run at the smaller size from that batch on)."""
        import torch

        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        replies: list[list[int]] = [[] for _ in prompts]
        start = 0
        while start < len(order):
            rows = order[start : start + self.batch_size]
            random_state = torch.random.get_rng_state(), _cuda_rng_state(self.device)
            try:
                batch = self._padded_batch([prompts[i] for i in rows], temperature, max_new_tokens)
            except torch.OutOfMemoryError as err:
                if len(rows) == 1:
                    raise ExpmanError(
                        f"generate: the GPU has no memory for one prompt of {len(prompts[rows[0]])} tokens and "
                        f"{max_new_tokens} new ones; lower generate.max_new_tokens or use a larger GPU"
                    ) from err
                self._halve_batch(len(rows), random_state)
                continue
            for i, reply in zip(rows, batch, strict=True):
                replies[i] = reply
            start += len(rows)
        return replies

    def _padded_batch(self, prompts: list[list[int]], temperature: float, max_new_tokens: int) -> list[list[int]]:
        import torch

        width = max(len(prompt) for prompt in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, prompt in enumerate(prompts):
            ids[r, width - len(prompt) :] = torch.tensor(prompt)
            mask[r, width - len(prompt) :] = 1
        with torch.inference_mode(), attention_kernels(self.params.cudnn_attention):
            out = self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                generation_config=self._sampling(temperature, max_new_tokens),
            )
        return out[:, width:].tolist()

    def _halve_batch(self, rows: int, random_state: tuple[Any, Any]) -> None:
        """After an out-of-memory error at ``rows``: free the cache, put the random state back, go on at half."""
        import torch

        torch.cuda.empty_cache()
        torch.random.set_rng_state(random_state[0])
        if random_state[1] is not None:
            torch.cuda.set_rng_state(random_state[1])
        self.batch_size = rows // 2
        print(
            f"generate: the GPU ran out of memory at a batch of {rows}; going on at {self.batch_size} "
            f"(set generate.batch_size: {self.batch_size} to start there)",
            file=sys.stderr,
            flush=True,
        )

    def _continuous(self, prompts: Sequence[list[int]], temperature: float, max_new_tokens: int) -> list[list[int]]:
        """transformers' continuous batching: every prompt queued at once, a finished reply's KV pages reused by
        the next prompt; it reports a failed request in its result, which is an error here."""
        import torch
        from transformers import ContinuousBatchingConfig

        seed = int(torch.randint(0, 2**31 - 1, (1,)).item())  # from the global generator: seeded once per shard
        results = self.model.generate_batch(
            [list(p) for p in prompts],
            generation_config=self._sampling(temperature, max_new_tokens),
            continuous_batching_config=ContinuousBatchingConfig(seed=seed),
        )
        replies = list(results.values())
        for n, (prompt, reply) in enumerate(zip(prompts, replies, strict=False)):
            if reply.error or list(reply.prompt_ids) != list(prompt):
                raise ExpmanError(f"generate: continuous batching request {n}: {reply.error or 'another prompt'}")
        if len(replies) != len(prompts):
            raise ExpmanError(f"generate: continuous batching returned {len(replies)} of {len(prompts)} replies")
        return [list(reply.generated_tokens) for reply in replies]

    def _output(self, prompt: list[int], generated: list[int]) -> GenOutput:
        """The reply up to and including its first EOS; without one it stopped at the length limit."""
        stop = next((n for n, t in enumerate(generated) if t in self.eos_ids), None)
        kept = generated if stop is None else generated[: stop + 1]
        text = self.tokenizer.decode(kept, skip_special_tokens=True)
        return GenOutput(list(prompt), kept, text, "length" if stop is None else "stop")


def _cuda_rng_state(device: str) -> Any:
    import torch

    return torch.cuda.get_rng_state() if device.startswith("cuda") else None


def _check_cpu_continuous_batching() -> None:
    """transformers' continuous batching sizes its KV pages from the GPU's free memory whenever CUDA is present,
    and pins its host buffers, so a CPU model on a CUDA host fails to allocate them (CUDA out of memory, measured
    on an H100 host with transformers 5.17; the sizing is the same in 5.19)."""
    import torch

    if torch.cuda.is_available():
        raise ExpmanError(
            "generate.hf_batching: continuous with generate.device cpu cannot run on a host with CUDA "
            "(transformers sizes its cache for the GPU); set generate.device: cuda or hf_batching: padded"
        )


def _make_backend(model_dir: Path, params: GenerateParams) -> Backend:
    if params.backend == "vllm":
        from expman.data.verifier import load_verifier_manifest
        from expman.engines.vllm import VllmGenerator

        return VllmGenerator(model_dir, params, load_verifier_manifest(model_dir)["trust_remote_code"])
    return HFBackend(model_dir, params)


def _regenerate(
    backend: Backend, conversations: Sequence[Conversation], section: GenerateParams
) -> list[dict[str, Any]]:
    """Answer every user turn in order (main responses at ``temperature``, sampled copies at
    ``sample_temperature``, each request seeded from its conversation id); return one record per conversation."""
    histories: list[Messages] = [[{"role": "system", "content": c.system}] if c.system else [] for c in conversations]
    last: list[GenOutput | None] = [None] * len(conversations)
    for turn in range(max(len(c.user_turns) for c in conversations)):
        for sampled in (False, True):
            active = [i for i, c in enumerate(conversations) if turn < len(c.user_turns) and bool(c.sample) == sampled]
            if not active:
                continue
            for i in active:
                histories[i].append({"role": "user", "content": conversations[i].user_turns[turn]})
            temperature = section.sample_temperature if sampled else section.temperature
            seeds = [section.seed + zlib.crc32(conversations[i].id.encode()) for i in active]
            for i, output in zip(
                active, backend.generate([histories[i] for i in active], temperature, seeds), strict=True
            ):
                histories[i].append({"role": "assistant", "content": output.text})
                last[i] = output
    records = []
    for conversation, history, output in zip(conversations, histories, last, strict=True):
        assert output is not None
        ok = bool(output.text.strip())
        records.append(
            {
                "id": conversation.id,
                "category": conversation.category,
                "split": conversation.split,
                "messages": history,
                "input_ids": output.prompt_ids + output.output_ids,
                "prompt_tokens": len(output.prompt_ids),
                "response_tokens": len(output.output_ids),
                "finish_reason": output.finish_reason,
                "ok": ok,
                "error": None if ok else "empty response",
            }
        )
    return records


def _remove_other_folders(folder: Path, keep: set[str]) -> None:
    """Delete the folders of splits or self prompts that the current plan no longer has (self_prompts.count back
    to 0, a split's dataset removed), so the folder holds only what the manifest lists."""
    import shutil

    for child in folder.iterdir() if folder.is_dir() else ():
        if child.is_dir() and not child.name.startswith(".") and child.name not in keep:
            shutil.rmtree(child)


def _publish(state: Path, out: Path, files: list[str]) -> None:
    """Put the state's finished ``files`` (paths relative to both folders) into the stage's output and nothing else:
    by hard link where the file system allows (no second copy), by copy elsewhere."""
    import shutil

    if out.is_dir():
        shutil.rmtree(out)
    for name in files:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(state / name, out / name)
        except OSError:
            shutil.copy2(state / name, out / name)


def _prompt_pools(
    conversations: dict[str, list[Conversation]],
) -> tuple[list[str], list[str], dict[str, list[str]]]:
    """What prompt writing needs from the datasets: the held-out turns (never kept, nor near copies), the train
    turns (duplicates of these are dropped) and the train prompts by category (the examples' pool)."""
    heldout = [turn for c in conversations.get("heldout", []) for turn in c.user_turns]
    known = [turn for c in conversations.get("train", []) for turn in c.user_turns]
    shipped: dict[str, list[str]] = {}
    for conversation in conversations.get("train", []):
        shipped.setdefault(conversation.category, []).append(conversation.user_turns[0])
    return heldout, known, shipped


def _self_prompts(
    verifier_dir: Path,
    section: GenerateParams,
    settings: dict[str, Any],
    conversations: dict[str, list[Conversation]],
    state: Path,
) -> tuple[Backend | None, dict[str, Any]]:
    """Add the prompts the verifier writes itself to the train conversations (written once, then reused while
    their plan is unchanged); return the backend, if one had to be started, and the prompts' manifest entry."""
    import torch

    from expman.data.self_prompts import PromptFilter, WritingContexts, write_prompts
    from expman.data.verifier import load_tokenizer

    wanted = section.self_prompts
    heldout, known, shipped = _prompt_pools(conversations)
    contexts = WritingContexts(load_tokenizer(verifier_dir), section.chat_template_kwargs, wanted, shipped)
    shards = ShardSet(state / "self_prompts")
    key = sha256_json(
        {
            "settings": {**settings, "backend": section.backend, "device": section.device},
            "self_prompts": wanted.model_dump(),
            "prefix": contexts(0)[0],
            "heldout": heldout,
            "known": known,
        }
    )
    name = "prompts.jsonl"
    backend: Backend | None = None
    entry = shards.done(name, key)
    if entry is None:
        backend = _make_backend(verifier_dir, section)
        torch.manual_seed(wanted.seed)  # the hf backend samples from the global generator
        report = write_prompts(backend, contexts, PromptFilter(wanted, heldout, known), section.batch_size)
        numbered = enumerate(zip(report.prompts, report.categories, strict=True))
        lines = [{"id": f"self-{i:06d}", "category": c, "prompt": p} for i, (p, c) in numbered]
        entry = shards.write(name, key, _write_jsonl(lines), **report.facts(wanted))
    shards.remove_others({name})
    path = verify_shard(shards.folder, entry)
    with open(path, encoding="utf-8") as handle:
        records = [json.loads(line) for line in handle]
    conversations.setdefault("train", []).extend(
        Conversation(r["id"], r["category"], "train", None, (r["prompt"],)) for r in records
    )
    return backend, {**entry, "path": f"self_prompts/{name}"}


def _self_prompt_metrics(entry: dict[str, Any]) -> dict[str, float]:
    counts = {"candidates": entry["candidates"], "kept": entry["kept"]}
    counts.update({f"dropped.{reason}": n for reason, n in entry["dropped"].items()})
    counts.update({f"kept.{category}": n for category, n in entry.get("kept_by_category", {}).items()})
    return {f"self_prompts.{name}": float(n) for name, n in counts.items()}


def _write_jsonl(records: list[dict[str, Any]]) -> Any:
    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as handle:
            for record in records:
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")

    return write


def _read_conversations(section: GenerateParams) -> tuple[dict[str, list[Conversation]], dict[str, int]]:
    """Every dataset's conversations by split (an id may appear once across all of them), and how many sampled
    responses each train conversation gets (its file's ``sampled_responses``, else the section's)."""
    conversations: dict[str, list[Conversation]] = {}
    copies: dict[str, int] = {}
    seen: dict[str, str] = {}
    for spec in section.datasets:
        count = section.sampled_responses if spec.sampled_responses is None else spec.sampled_responses
        for conversation in read_dataset(spec, Path.cwd(), section.max_turns):
            if conversation.id in seen:
                raise ExpmanError(f"{spec.path}: id {conversation.id!r} also appears in {seen[conversation.id]}")
            seen[conversation.id] = spec.path
            conversations.setdefault(spec.split, []).append(conversation)
            if spec.split == "train":
                copies[conversation.id] = count
    return conversations, copies


def _sampled_copies(originals: list[Conversation], copies: dict[str, int]) -> list[Conversation]:
    """The sampled copies of the train conversations: every first copy, then every second one, and so on: with
    one count for all files, the order (and so the shards) of a run made before per-file counts."""
    most = max(copies.values(), default=0)
    return [c.sampled(k) for k in range(1, most + 1) for c in originals if copies[c.id] >= k]


def _write_split(
    where: GeneratePaths, split: str, items: list[Conversation], section: GenerateParams, settings: dict, backend, bar
) -> tuple[dict[str, Any], int, Backend | None]:
    """The shards of one split, each regenerated unless done under the same plan key; the split's manifest entry,
    the tokens generated now and the backend (started on the first shard that needs it)."""
    import torch

    shards = ShardSet(where.state / split)
    entries = []
    new_tokens = 0
    for index, start in enumerate(range(0, len(items), section.shard_size)):
        chunk = items[start : start + section.shard_size]
        name = f"shard-{index:05d}.jsonl"
        key = sha256_json({"settings": settings, "conversations": [asdict(c) for c in chunk]})
        entry = shards.done(name, key)
        if entry is None:
            backend = backend or _make_backend(where.verifier, section)
            torch.manual_seed(section.seed + index)  # sampling replays the same after a resume
            records = _regenerate(backend, chunk, section)
            facts = {
                "records": len(records),
                "failed": sum(not r["ok"] for r in records),
                "prompt_tokens": sum(r["prompt_tokens"] for r in records),
                "response_tokens": sum(r["response_tokens"] for r in records),
            }
            entry = shards.write(name, key, _write_jsonl(records), **facts)
            new_tokens += facts["response_tokens"]
        entries.append(entry)
        bar.update(len(chunk))
    shards.remove_others({e["path"] for e in entries})
    return {"shards": entries, **{k: sum(e[k] for e in entries) for k in SHARD_COUNTS}}, new_tokens, backend


def generate(params: Params, where: GeneratePaths) -> dict[str, Any]:
    """Regenerate responses for every dataset of ``params.generate`` into ``where.out/<split>/shard-*.jsonl``
    (written shard by shard into ``where.state``, then linked into ``where.out``)."""
    from tqdm import tqdm

    section = params.generate
    precision = precision_facts(resolve_device(section.device), section.dtype)
    verifier_manifest = read_manifest(where.verifier / "manifest.json", "prepare")
    conversations, copies = _read_conversations(section)
    upstream = {"prepare": upstream_entry(where.verifier / "manifest.json")}
    settings = {
        "verifier_weights": verifier_manifest["verifier"]["weights_sha256"],
        "tokenizer": verifier_manifest["verifier"]["tokenizer_sha256"],
        **section.model_dump(exclude=set(NOT_IN_SETTINGS)),
        "dtype": precision["dtype"],  # what auto resolved to on this machine: another dtype, other responses
    }
    with stage_run("generate", section.model_dump() | {"resolved": precision}, upstream) as run:
        backend: Backend | None = None
        self_prompted: dict[str, Any] | None = None
        if section.self_prompts.count:
            backend, self_prompted = _self_prompts(where.verifier, section, settings, conversations, where.state)
            run.log_metrics(_self_prompt_metrics(self_prompted))
        written = section.self_prompts.sampled_responses
        originals = conversations.get("train", [])
        for conversation in originals:  # those no dataset file gave: the written prompts
            copies.setdefault(conversation.id, section.sampled_responses if written is None else written)
        conversations["train"] = originals + _sampled_copies(originals, copies)  # originals first: shards stay
        splits: dict[str, Any] = {}
        started = time.perf_counter()
        new_tokens = 0
        with tqdm(total=sum(len(c) for c in conversations.values()), desc="generate", unit="conv") as bar:
            for split, items in conversations.items():
                splits[split], tokens, backend = _write_split(where, split, items, section, settings, backend, bar)
                new_tokens += tokens
        if backend is not None:
            backend.close()
        elapsed = time.perf_counter() - started
        metrics = {f"{split}.{k}": v for split, s in splits.items() for k, v in s.items() if k != "shards"}
        if new_tokens:
            metrics["generated_tok_per_s"] = new_tokens / elapsed
        if isinstance(backend, HFBackend) and backend.batch_size < section.batch_size:
            metrics["batch_size_after_out_of_memory"] = backend.batch_size
        run.log_metrics(metrics)
        facts = {"backend": section.backend, "precision": precision, "verifier": verifier_manifest["verifier"]}
        facts["splits"] = splits
        if self_prompted is not None:
            facts["self_prompts"] = self_prompted
        _remove_other_folders(where.state, {*splits, *(["self_prompts"] if self_prompted else [])})
        files = [f"{split}/{shard['path']}" for split, written in splits.items() for shard in written["shards"]]
        _publish(where.state, where.out, files + ([self_prompted["path"]] if self_prompted else []))
        return run.write_manifest(where.out / "manifest.json", facts)


def read_responses(generated_dir: Path, split: str, verify: bool = True) -> list[dict[str, Any]]:
    """The successful records of one split, in manifest order; shards are checksum-verified."""

    manifest = read_manifest(generated_dir / "manifest.json", "generate")
    if split not in manifest["splits"]:
        raise ExpmanError(f"{generated_dir / 'manifest.json'}: no {split!r} split (add a dataset with split: {split})")
    records = []
    for entry in manifest["splits"][split]["shards"]:
        path = verify_shard(generated_dir / split, entry) if verify else generated_dir / split / entry["path"]
        with open(path, encoding="utf-8") as handle:
            records.extend(r for r in map(json.loads, handle) if r["ok"])
    return records
