"""A local model's reasoning: what a reasoning model writes between its tags (`<think>`, `</think>`), sent apart from
its answer's content, as llama.cpp's server does by default and vLLM's reasoning parsers do (OpenAI's
`reasoning_content`, Anthropic's thinking blocks)."""

from __future__ import annotations

from dataclasses import replace

from prefixgate.backends import TokenChunk
from prefixgate.backends.text_stream import held_length


class ReasoningStream:
    """Split an answer, chunk by chunk, into reasoning and content: an answer that opens with the opening tag (after
    white space), or whose prompt ends with it, reasons until the closing tag; the rest is content. A piece that may
    begin a tag is held back until it is one or is not; white space after a tag is left out."""

    def __init__(self, tags: tuple[str, str], *, opened: bool) -> None:
        self._open, self._close = tags
        self._part = "reasoning" if opened else "start"  # "start" until the answer shows whether it reasons
        self._held = ""
        self._leading = True  # the part has sent nothing yet

    def chunk(self, chunk: TokenChunk) -> TokenChunk:
        """Return the chunk with its text split into reasoning and content."""
        self._held += chunk.text
        reasoning, content = self._split(final=chunk.finish_reason is not None)
        return replace(chunk, text=content, reasoning=reasoning)

    def _split(self, *, final: bool) -> tuple[str, str]:
        reasoning = ""
        if self._part == "start":
            begun = self._held.lstrip()
            if begun.startswith(self._open):
                self._part, self._held = "reasoning", begun[len(self._open) :]
            elif (not begun or self._open.startswith(begun)) and not final:
                return "", ""  # white space, or the tag's first characters: wait
            else:
                self._part, self._leading = "content", False  # an answer that does not reason goes as it is
        if self._part == "reasoning":
            at = self._held.find(self._close)
            if at < 0:
                keep = 0 if final else held_length(self._held, (self._close,))
                reasoning = self._sent(self._held[: len(self._held) - keep])
                self._held = self._held[len(self._held) - keep :]
                return reasoning, ""
            reasoning = self._sent(self._held[:at])
            self._part, self._held, self._leading = "content", self._held[at + len(self._close) :], True
        content, self._held = self._sent(self._held), ""
        return reasoning, content

    def _sent(self, text: str) -> str:
        """Return text to send in the current part, without the white space that would begin it."""
        if self._leading:
            text = text.lstrip()
            self._leading = not text
        return text
