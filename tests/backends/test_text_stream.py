"""Incremental decoding: stable text only, whole characters only, and nothing of a stop string."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerFast

from prefixgate.backends.text_stream import TextStream, held_length


def stream_of(
    tokenizer: PreTrainedTokenizerFast, text: str, stop: tuple[str, ...] = ()
) -> tuple[list[str], str | None]:
    """Push the tokens of `text` one by one; return the pieces released and the stop string that ended it, if any."""
    ids = tokenizer(text)["input_ids"]
    stream = TextStream(lambda t: tokenizer.decode(t, skip_special_tokens=True), [], stop)
    pieces: list[str] = []
    for token in ids:
        delta = stream.push(token)
        pieces.append(delta.text)
        if delta.stop is not None:
            return pieces, delta.stop
    pieces.append(stream.finish().text)
    return pieces, None


def test_multi_byte_characters_are_released_whole(tokenizer: PreTrainedTokenizerFast) -> None:
    text = "Grüße aus Köln — ça va? 🙂 ok"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) > len(text) // 2, "the tiny tokenizer splits these characters into byte tokens"
    pieces, stopped = stream_of(tokenizer, text)
    assert stopped is None
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)
    assert "" in pieces, "some tokens complete no character and release nothing"


def test_stop_string_split_across_tokens_is_held_back_then_cut(tokenizer: PreTrainedTokenizerFast) -> None:
    pieces, stopped = stream_of(tokenizer, "alpha beta STOP gamma", stop=("STOP",))
    assert stopped == "STOP"
    assert "".join(pieces) == "alpha beta "


def test_text_that_only_starts_like_a_stop_string_is_released_at_the_end(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    pieces, stopped = stream_of(tokenizer, "alpha ST", stop=("STOP",))
    assert stopped is None
    assert "".join(pieces) == "alpha ST"
    assert pieces[-1].endswith("ST"), "the possible start of the stop string was held back until finish"


def test_earliest_of_several_stop_strings_wins(tokenizer: PreTrainedTokenizerFast) -> None:
    pieces, stopped = stream_of(tokenizer, "one two three four", stop=("four", "two"))
    assert stopped == "two"
    assert "".join(pieces) == "one "


def test_first_generated_word_keeps_its_leading_space(tokenizer: PreTrainedTokenizerFast) -> None:
    prompt = tokenizer("The quick")["input_ids"]
    generated = tokenizer(" brown fox")["input_ids"]
    stream = TextStream(lambda t: tokenizer.decode(t), prompt)
    text = "".join(stream.push(t).text for t in generated) + stream.finish().text
    assert text == " brown fox"


def longest_stop_prefix_by_every_length(text: str, stop: tuple[str, ...]) -> int:
    """Return the longest end of `text` that a stop string starts with, trying every length: the reference."""
    ends = [k for s in stop for k in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:k])]
    return max(ends, default=0)


@given(st.text(alphabet="ab\n", max_size=40), st.lists(st.text(alphabet="ab\n", max_size=12), max_size=4))
def test_the_held_back_end_is_the_longest_start_of_a_stop_string(text: str, stop: list[str]) -> None:
    assert held_length(text, tuple(stop)) == longest_stop_prefix_by_every_length(text, tuple(stop))
