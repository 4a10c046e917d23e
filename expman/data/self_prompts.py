"""Prompts the verifier writes itself (the Magpie method): sampled from its chat template's user-turn prefix.

Given only the text a chat template puts before a user's message, an instruction-tuned model writes a plausible
user turn and closes it with its end-of-turn token. That yields as many distinct prompts as one samples, in the
verifier's own distribution, with no dataset to download. Candidates then pass filters (empty, too short, too long,
not text, refusals), exact and near-duplicate removal (MinHash LSH over character 5-grams, from datasketch), and
a guard that no held-out prompt, nor a near copy of one, enters training (exact Jaccard and containment against
every held-out turn, not a probabilistic index). The report counts what each filter dropped.

With ``examples`` > 0 the verifier first sees a few shipped train prompts of one category as earlier user turns
(in-context Magpie): the turn it then writes follows that category, so the written prompts move toward the shipped
prompts' categories (and the held-out set's, which shares them) without a held-out prompt in sight.
"""

from __future__ import annotations

import random
import re
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from expman.errors import ExpmanError
from expman.params import SelfPromptParams

__all__ = ["DROP_REASONS", "PromptFilter", "SelfPromptReport", "WritingContexts", "user_turn_prefix", "write_prompts"]

DROP_REASONS = (
    "empty",
    "too_short",
    "too_long",
    "not_text",
    "refusal",
    "exact_duplicate",
    "near_duplicate",
    "heldout_near_copy",
)
SHINGLE = 5
MINHASH_PERMUTATIONS = 128
SENTINEL = "\x00expman-user-turn\x00"
EXAMPLE_REPLY = "Sure."
"""The assistant turn after each example: templates that insist on alternating roles (Llama 2's, Mistral's) raise on
two user turns in a row, and a short reply keeps the verifier's attention on the user turns."""
REFUSAL = re.compile(
    r"\b(i'?m sorry|i am sorry|i apologi[sz]e|i can(?:'|no)t (?:help|assist|answer|provide)|i'?m unable|"
    r"i am unable|as an ai\b|as a language model)",
    re.IGNORECASE,
)
CHARACTERS_OF_TEXT = {"L", "N", "P", "Z", "S"}  # letters, numbers, punctuation, separators, symbols


def user_turn_prefix(tokenizer: Any, chat_template_kwargs: dict[str, Any], examples: Sequence[str] = ()) -> list[int]:
    """The token ids the chat template puts before a user's message (its default system turn included), after
    ``examples`` as earlier user turns each answered with ``EXAMPLE_REPLY``: render the conversation with a sentinel
    as the last user message and keep what precedes it."""
    earlier = [
        message
        for example in examples
        for message in ({"role": "user", "content": example}, {"role": "assistant", "content": EXAMPLE_REPLY})
    ]
    rendered = tokenizer.apply_chat_template(
        [*earlier, {"role": "user", "content": SENTINEL}],
        tokenize=False,
        add_generation_prompt=False,
        **chat_template_kwargs,
    )
    if SENTINEL not in rendered:
        raise ExpmanError("generate.self_prompts: the verifier's chat template does not render a user message verbatim")
    return list(tokenizer(rendered.split(SENTINEL, 1)[0], add_special_tokens=False)["input_ids"])


@dataclass
class WritingContexts:
    """What the verifier sees before candidate i writes, and the category its prompt is filed under: the bare
    user-turn prefix (Magpie as published), or ``examples`` shipped train prompts of one category before it, the
    categories taken in turn and the examples drawn with seed ``seed + i`` (the same candidates after a resume)."""

    tokenizer: Any
    chat_template_kwargs: dict[str, Any]
    settings: SelfPromptParams
    shipped: dict[str, list[str]]
    """Train prompts by category, the examples' pool; never a held-out prompt."""

    def __post_init__(self) -> None:
        if self.settings.examples and not self.shipped:
            raise ExpmanError("generate.self_prompts.examples: no train prompt to show (no dataset has split: train)")
        self._bare = user_turn_prefix(self.tokenizer, self.chat_template_kwargs)
        self._categories = sorted(self.shipped)

    def __call__(self, index: int) -> tuple[list[int], str]:
        if not self.settings.examples:
            return self._bare, self.settings.category
        category = self._categories[index % len(self._categories)]
        pool = self.shipped[category]
        shown = random.Random(self.settings.seed + index).sample(pool, min(self.settings.examples, len(pool)))
        prefix = user_turn_prefix(self.tokenizer, self.chat_template_kwargs, shown)
        return prefix, f"{self.settings.category}-{category}"


def _normal(text: str) -> str:
    """Casefolded words of ``text``, joined by single spaces (punctuation dropped): the exact-duplicate key."""
    return " ".join(re.findall(r"\w+", unicodedata.normalize("NFKC", text).casefold()))


def _shingles(normal: str) -> set[str]:
    """The character 5-grams of a normalized text (the text itself when shorter)."""
    if len(normal) <= SHINGLE:
        return {normal}
    return {normal[i : i + SHINGLE] for i in range(len(normal) - SHINGLE + 1)}


def _is_text(text: str) -> bool:
    """Printable text, at least half of it letters: not control bytes, replacement characters or symbol runs."""
    if "\ufffd" in text or any(unicodedata.category(c)[0] not in CHARACTERS_OF_TEXT for c in text if c not in "\n\t"):
        return False
    visible = [c for c in text if not c.isspace()]
    return sum(c.isalpha() for c in visible) >= len(visible) / 2


@dataclass
class PromptFilter:
    """Keeps candidates that pass every filter and duplicate none kept before them, nor any protected text."""

    settings: SelfPromptParams
    heldout: Sequence[str]
    """Held-out turns: a near copy of one (Jaccard or containment at ``near_duplicate``) is never kept."""
    known: Iterable[str] = ()
    """Prompts already in training: duplicates of these are dropped too."""
    dropped: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        from datasketch import MinHashLSH

        self._lsh = MinHashLSH(threshold=self.settings.near_duplicate, num_perm=MINHASH_PERMUTATIONS)
        self._exact: set[str] = set()
        self._heldout_normal = {_normal(t) for t in self.heldout}
        self._heldout = [_shingles(n) for n in map(_normal, self.heldout)]
        self._by_shingle: dict[str, list[int]] = {}
        for index, shingles in enumerate(self._heldout):
            for shingle in shingles:
                self._by_shingle.setdefault(shingle, []).append(index)
        for text in self.known:
            normal = _normal(text)
            if normal not in self._exact:
                self._remember(normal, self._minhash(_shingles(normal)))

    def _remember(self, normal: str, signature: Any) -> None:
        self._exact.add(normal)
        self._lsh.insert(str(len(self._exact)), signature)

    @staticmethod
    def _minhash(shingles: set[str]) -> Any:
        from datasketch import MinHash

        signature = MinHash(num_perm=MINHASH_PERMUTATIONS, seed=1)
        signature.update_batch([s.encode() for s in shingles])
        return signature

    def near_heldout(self, text: str) -> bool:
        """True when ``text`` equals, overlaps (Jaccard) or contains a held-out turn at the threshold; exact."""
        normal = _normal(text)
        return self._near_heldout(normal, _shingles(normal))

    def _near_heldout(self, normal: str, shingles: set[str]) -> bool:
        if normal in self._heldout_normal:
            return True
        shared = Counter(i for s in shingles for i in self._by_shingle.get(s, ()))
        threshold = self.settings.near_duplicate
        for index, common in shared.items():
            other = len(self._heldout[index])
            if common / (len(shingles) + other - common) >= threshold or common / other >= threshold:
                return True
        return False

    def reason(self, text: str, stopped: bool) -> str | None:
        """Why ``text`` (a candidate that ended its turn when ``stopped``) is dropped, or None to keep it."""
        words = len(text.split())
        if not text.strip():
            return "empty"
        if not stopped or words > self.settings.max_words:
            return "too_long"
        if words < self.settings.min_words:
            return "too_short"
        if not _is_text(text):
            return "not_text"
        if REFUSAL.search(text):
            return "refusal"
        normal = _normal(text)
        shingles = _shingles(normal)
        if self._near_heldout(normal, shingles):
            return "heldout_near_copy"
        if normal in self._exact:
            return "exact_duplicate"
        signature = self._minhash(shingles)
        if self._lsh.query(signature):
            return "near_duplicate"
        self._remember(normal, signature)
        return None

    def keep(self, text: str, stopped: bool) -> bool:
        reason = self.reason(text, stopped)
        if reason is not None:
            self.dropped[reason] += 1
        return reason is None


@dataclass(frozen=True)
class SelfPromptReport:
    """What prompt writing did: candidates sampled, prompts kept (with their categories), and what each filter
    dropped."""

    prompts: list[str]
    categories: list[str]
    candidates: int
    dropped: dict[str, int]

    def facts(self, settings: SelfPromptParams) -> dict[str, Any]:
        return {
            "settings": settings.model_dump(),
            "candidates": self.candidates,
            "kept": len(self.prompts),
            "kept_by_category": dict(sorted(Counter(self.categories).items())),
            "dropped": self.dropped,
        }


def write_prompts(
    backend: Any,
    contexts: Callable[[int], tuple[list[int], str]],
    prompt_filter: PromptFilter,
    batch_size: int,
) -> SelfPromptReport:
    """Sample user turns, candidate i from ``contexts(i)``'s prefix, in seeded batches until ``count`` pass
    ``prompt_filter`` or ``max_candidates`` were examined. Candidate i is drawn with seed ``seed + i``: the same
    settings give the same prompts on the same engine and device. Samples past the ``count``-th kept prompt are not
    examined."""
    from tqdm import tqdm

    settings = prompt_filter.settings
    kept: list[str] = []
    categories: list[str] = []
    candidates = 0
    bar = tqdm(total=settings.count, desc="self prompts", unit="prompt")
    while len(kept) < settings.count and candidates < settings.max_candidates:
        size = min(batch_size, settings.max_candidates - candidates)
        batch = [contexts(candidates + i) for i in range(size)]
        seeds = [settings.seed + candidates + i for i in range(size)]
        outputs = backend.complete([prefix for prefix, _ in batch], settings.temperature, seeds, settings.max_tokens)
        for output, (_, category) in zip(outputs, batch, strict=True):
            if len(kept) == settings.count:
                break
            candidates += 1
            text = output.text.strip()
            if prompt_filter.keep(text, output.finish_reason == "stop"):
                kept.append(text)
                categories.append(category)
                bar.update()
        bar.set_postfix(candidates=candidates)
    bar.close()
    dropped = {reason: prompt_filter.dropped[reason] for reason in DROP_REASONS}
    return SelfPromptReport(kept, categories, candidates, dropped)
