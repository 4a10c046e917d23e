"""Prompt and conversation files (expman, ShareGPT, OpenAI) and the draft-vocab construction."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from expman.data.conversations import read_dataset
from expman.data.vocab import build_vocab, draft_vocab_size
from expman.errors import ExpmanError
from expman.params import DatasetSpec

REPO = Path(__file__).resolve().parents[1]


def _write(tmp_path: Path, lines: list[object] | bytes) -> DatasetSpec:
    path = tmp_path / "data.jsonl"
    if isinstance(lines, bytes):
        path.write_bytes(lines)
    else:
        path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return DatasetSpec.model_construct(path="data.jsonl", split="train", format="auto", max_samples=None)


def test_shipped_prompt_sets_cover_the_eight_categories() -> None:
    categories = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
    texts = set()
    for split, minimum in (("train", 300), ("heldout", 80)):
        spec = DatasetSpec.model_construct(
            path=f"data/prompts/{split}.jsonl", split=split, format="prompts", max_samples=None
        )
        records = read_dataset(spec, REPO, max_turns=1)
        assert len(records) >= minimum
        assert {r.category for r in records} == categories
        texts |= {r.user_turns[0] for r in records}
    assert len(texts) >= 380  # no prompt shared between train and held-out


def test_three_formats_read_alike(tmp_path: Path) -> None:
    spec = _write(
        tmp_path,
        [
            {"id": "a", "prompt": "Hi?", "category": "math"},
            {
                "conversations": [
                    {"from": "system", "value": "Be brief."},
                    {"from": "human", "value": "One"},
                    {"from": "gpt", "value": "old answer"},
                    {"from": "human", "value": "Two"},
                ]
            },
            {"messages": [{"role": "user", "content": "Three"}, {"role": "assistant", "content": "x"}]},
        ],
    )
    records = read_dataset(spec, tmp_path, max_turns=4)
    assert [r.user_turns for r in records] == [("Hi?",), ("One", "Two"), ("Three",)]
    assert records[1].system == "Be brief." and records[0].category == "math" and records[2].id == "data-3"
    assert read_dataset(spec, tmp_path, max_turns=1)[1].user_turns == ("One",)


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        (["{not json"], r"data.jsonl:1: invalid JSON"),
        ([], r"data.jsonl: no records"),
        ([{"text": "x"}], r'data.jsonl:1: record has none of "prompt", "conversations", "messages"'),
        ([{"prompt": ""}], r'data.jsonl:1: "prompt" must be a non-empty string'),
        (
            [{"prompt": "a"}, {"messages": [{"role": "robot", "content": "x"}]}],
            r"data.jsonl:2: messages\[0\] has unknown role",
        ),
        ([{"conversations": [{"from": "gpt", "value": "only the answer"}]}], r"data.jsonl:1: no user turn"),
        ([{"messages": [{"role": "user"}]}], r'data.jsonl:1: messages\[0\] needs a string "content"'),
        ([[1, 2]], r"data.jsonl:1: expected a JSON object"),
        ([{"id": "x", "prompt": "a"}, {"id": "x", "prompt": "b"}], r"data.jsonl:2: duplicate id 'x'"),
        (b'{"prompt": "caf\xe9"}\n', r"data.jsonl: not UTF-8 \(byte 15\)"),
    ],
)
def test_bad_records_name_file_and_line(tmp_path: Path, lines: list[object] | bytes, expected: str) -> None:
    spec = _write(tmp_path, lines)
    with pytest.raises(ExpmanError, match=expected):
        read_dataset(spec, tmp_path, max_turns=1)


def test_explicit_format_requires_its_key(tmp_path: Path) -> None:
    spec = _write(tmp_path, [{"prompt": "hi"}]).model_copy(update={"format": "sharegpt"})
    with pytest.raises(ExpmanError, match=r'data.jsonl:1: missing "conversations" \(sharegpt format\)'):
        read_dataset(spec, tmp_path, max_turns=1)


def test_draft_vocab_by_frequency_ties_to_lower_id() -> None:
    counts = torch.tensor([0, 5, 1, 5, 0, 9, 1, 0])
    d2t, t2d = build_vocab(counts, 4)
    chosen = torch.nonzero(t2d).flatten()
    assert chosen.tolist() == [1, 2, 3, 5]  # 9, 5, 5, then the lower of the two 1s
    assert torch.equal(torch.arange(4) + d2t, chosen)
    assert d2t.dtype == torch.int64 and int(t2d.sum()) == 4


def test_draft_vocab_size_resolution() -> None:
    assert draft_vocab_size("auto", 49152) == 8192
    assert draft_vocab_size(4096, 49152) == 4096
    with pytest.raises(ExpmanError, match="vocab.draft_vocab_size: 60000 exceeds the verifier's vocab size 49152"):
        draft_vocab_size(60000, 49152)
