"""What a generation backend is (the HF backend in ``expman.data.generate``, vLLM's in ``expman.engines.vllm``):
the conversations it takes and the reply it returns. It lives with the engines so that they implement it without
importing ``expman.data``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Backend", "GenOutput", "Messages"]

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class GenOutput:
    """One generated reply: the prompt ids the engine saw, the generated ids (EOS included), the text."""

    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str


class Backend(Protocol):
    def generate(self, batch: Sequence[Messages], temperature: float, seeds: Sequence[int]) -> list[GenOutput]:
        """One reply per conversation of ``batch``, at ``temperature`` (0 = greedy); ``seeds`` has one seed per
        conversation for engines that seed each request."""
        ...

    def complete(
        self, prompts: Sequence[list[int]], temperature: float, seeds: Sequence[int], max_new_tokens: int
    ) -> list[GenOutput]:
        """Continue token-id prompts (no chat template applied), each up to its end of turn."""
        ...

    def close(self) -> None: ...
