"""Read prompt and conversation files into one shape: a list of OpenAI-style messages per record.

Accepted JSONL formats (auto-detected per record unless the dataset names one):
- expman prompts: ``{"id", "category", "prompt", "system"?}``
- ShareGPT: ``{"conversations": [{"from": "human"|"gpt"|"system", "value": ...}]}``
- OpenAI: ``{"messages": [{"role": "user"|"assistant"|"system", "content": ...}]}``
Existing assistant turns are dropped: generate regenerates them with the verifier.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from expman.errors import ExpmanError
from expman.params import DatasetSpec

__all__ = ["Conversation", "prompt_id", "read_dataset"]

SAMPLE_SEPARATOR = "~s"
FORMAT_KEYS = {"prompts": "prompt", "sharegpt": "conversations", "openai": "messages"}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


@dataclass(frozen=True)
class Conversation:
    """One record to regenerate: system prompt (if any) and user turns, in order."""

    id: str
    category: str
    split: str
    system: str | None
    user_turns: tuple[str, ...]
    sample: int = 0
    """0: the response at ``generate.temperature``; k > 0: the k-th one sampled at ``sample_temperature``."""

    def sampled(self, k: int) -> Conversation:
        """The k-th sampled copy, with its own id (``<id>~s<k>``)."""
        return replace(self, id=f"{self.id}{SAMPLE_SEPARATOR}{k}", sample=k)


def prompt_id(record_id: str) -> str:
    """The id of the conversation a record was generated from (a sampled copy's id without its suffix)."""
    return record_id.split(SAMPLE_SEPARATOR, 1)[0]


def _turns(record: dict[str, Any], fmt: str, where: str) -> tuple[str | None, list[str]]:
    if fmt == "auto":
        fmt = next((f for f, key in FORMAT_KEYS.items() if key in record), "")
        if not fmt:
            raise ExpmanError(f'{where}: record has none of "prompt", "conversations", "messages"')
    key = FORMAT_KEYS[fmt]
    if key not in record:
        raise ExpmanError(f'{where}: missing "{key}" ({fmt} format)')
    if fmt == "prompts":
        prompt = record["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise ExpmanError(f'{where}: "prompt" must be a non-empty string')
        return record.get("system"), [prompt]
    turns = record[key]
    if not isinstance(turns, list) or not turns:
        raise ExpmanError(f'{where}: "{key}" must be a non-empty list')
    role_key, text_key = ("from", "value") if fmt == "sharegpt" else ("role", "content")
    system, users = None, []
    for n, turn in enumerate(turns):
        if not isinstance(turn, dict) or not isinstance(turn.get(text_key), str):
            raise ExpmanError(f'{where}: {key}[{n}] needs a string "{text_key}"')
        role = SHAREGPT_ROLES.get(str(turn.get(role_key)))
        if role is None:
            raise ExpmanError(f"{where}: {key}[{n}] has unknown {role_key} {turn.get(role_key)!r}")
        if role == "system" and n == 0:
            system = turn[text_key]
        elif role == "user":
            users.append(turn[text_key])
    if not users:
        raise ExpmanError(f"{where}: no user turn to answer")
    return system, users


def read_dataset(spec: DatasetSpec, root: Path, max_turns: int) -> list[Conversation]:
    """All records of one dataset file; any bad line is an error naming file and line."""
    path = root / spec.path
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ExpmanError(f"{spec.path}: not UTF-8 (byte {err.start})") from None
    conversations, seen = [], set()
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{spec.path}:{line_no}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ExpmanError(f"{where}: invalid JSON ({err.msg})") from None
        if not isinstance(record, dict):
            raise ExpmanError(f"{where}: expected a JSON object")
        system, users = _turns(record, spec.format, where)
        record_id = str(record.get("id", f"{Path(spec.path).stem}-{line_no}"))
        if record_id in seen:
            raise ExpmanError(f"{where}: duplicate id {record_id!r}")
        if SAMPLE_SEPARATOR in record_id:
            raise ExpmanError(f"{where}: id {record_id!r} contains {SAMPLE_SEPARATOR!r}, which marks sampled copies")
        seen.add(record_id)
        category = str(record.get("category", "general"))
        conversations.append(Conversation(record_id, category, spec.split, system, tuple(users[:max_turns])))
        if spec.max_samples and len(conversations) >= spec.max_samples:
            break
    if not conversations:
        raise ExpmanError(f"{spec.path}: no records")
    return conversations
