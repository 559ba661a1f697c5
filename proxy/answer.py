"""An answer as a whole, assembled from the engine's chunks: what every face renders when a client does not stream."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prefixgate.backends import TokenChunk, TokenLogprob, ToolCallDelta
from prefixgate.backends.tool_calls import call_id


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One whole tool call: its id, the function's name and its arguments (JSON text)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Answer:
    """Everything one answer carried: its text, reasoning, refusal, tool calls and log probabilities, and the stop
    string that ended it (None when none did)."""

    text: str
    reasoning: str
    refusal: str
    tool_calls: tuple[ToolCall, ...]
    logprobs: tuple[TokenLogprob, ...]
    stop_sequence: str | None


def assemble(chunks: Iterable[TokenChunk]) -> Answer:
    """Return the whole answer the chunks make up; tool-call pieces join by their index, as OpenAI's clients join
    them."""
    text: list[str] = []
    reasoning: list[str] = []
    refusal: list[str] = []
    calls: dict[int, list[ToolCallDelta]] = {}
    logprobs: list[TokenLogprob] = []
    stop = None
    for chunk in chunks:
        text.append(chunk.text)
        reasoning.append(chunk.reasoning)
        refusal.append(chunk.refusal)
        for piece in chunk.tool_calls:
            calls.setdefault(piece.index, []).append(piece)
        logprobs += chunk.logprobs
        stop = chunk.stop_sequence
    return Answer(
        "".join(text),
        "".join(reasoning),
        "".join(refusal),
        tuple(_joined(calls[index]) for index in sorted(calls)),
        tuple(logprobs),
        stop,
    )


def _joined(pieces: list[ToolCallDelta]) -> ToolCall:
    given = next((piece.id for piece in pieces if piece.id), None)
    name = next((piece.name for piece in pieces if piece.name), "")
    return ToolCall(given or call_id(), name, "".join(piece.arguments for piece in pieces))
