"""The reply reader of the Redis command stream, on replies a real Redis does not send: malformed ones, RESP3 pushes
and values larger than their buffer, written by the test into one end of a socket pair. What Redis itself sends is
covered by the Redis tier's tests against a real redis-server."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from redis.exceptions import InvalidResponse, RedisError

from prefixgate.store import redis_stream
from prefixgate.store.redis_stream import OversizeValue, ReplyError, _Reader

Pair = tuple[socket.socket, _Reader]


@pytest.fixture
def pair() -> Iterator[Pair]:
    """Return the writing end of a socket pair and a reader of the other end."""
    ours, theirs = socket.socketpair()
    ours.settimeout(5.0)
    theirs.settimeout(5.0)  # only bounds a broken test: every reply read here was written before it
    yield ours, _Reader(theirs)
    ours.close()
    theirs.close()


def test_replies_of_every_kind_are_read_in_order_past_push_messages(pair: Pair) -> None:
    server, reader = pair
    server.sendall(
        b">2\r\n$10\r\ninvalidate\r\n*1\r\n$1\r\nk\r\n"  # a RESP3 push before the reply: not a reply
        b"*3\r\n$3\r\nfoo\r\n:42\r\n_\r\n"
        b"$-1\r\n+OK\r\n-WRONGTYPE not a string\r\n"
    )
    assert reader.reply() == [b"foo", 42, None]
    assert reader.reply() is None and reader.reply() == b"OK"
    error = reader.reply()
    assert isinstance(error, ReplyError) and str(error) == "WRONGTYPE not a string"


def test_a_value_lands_in_the_callers_buffer_and_anything_else_stands_as_an_error(pair: Pair) -> None:
    server, reader = pair
    value = bytes(range(256)) * 40  # more than the reader reads ahead at once
    server.sendall(b"$%d\r\n%s\r\n*1\r\n:1\r\n$%d\r\n%s\r\n$2\r\nok\r\n" % (len(value), value, len(value), value))
    buffer = bytearray(len(value) + 2)
    got = reader.bulk_into(buffer)
    assert isinstance(got, memoryview) and got.obj is buffer and got == value
    assert str(reader.bulk_into(buffer)) == "not a value: [1]"
    too_long = reader.bulk_into(bytearray(100))  # read through, never held: the stream goes on after it
    assert isinstance(too_long, OversizeValue) and f"{len(value)} bytes" in str(too_long)
    assert reader.bulk_into(buffer) == b"ok"


def test_a_large_value_read_as_a_small_reply_is_read_through_and_dropped(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_stream, "_SMALL_BYTES", 8)
    server, reader = pair
    server.sendall(b"*2\r\n$9\r\nfar too l\r\n$5\r\nshort\r\n:7\r\n")
    long, short = reader.reply()  # type: ignore[misc]
    assert isinstance(long, OversizeValue) and short == b"short"
    assert reader.reply() == 7


@pytest.mark.parametrize(
    "sent",
    [b"$abc\r\n", b"?what\r\n", b"$3\r\nfooXX", b"\r\n", b"x" * (70 << 10)],
    ids=["a malformed length", "an unknown type", "a value not ended by CRLF", "an empty line", "an endless line"],
)
def test_a_malformed_reply_is_a_redis_error_the_tier_counts_as_a_fault(pair: Pair, sent: bytes) -> None:
    server, reader = pair
    server.sendall(sent)
    with pytest.raises(InvalidResponse):
        reader.bulk_into(bytearray(64))
    assert issubclass(InvalidResponse, RedisError)


def test_a_connection_closed_mid_reply_is_a_connection_error(pair: Pair) -> None:
    server, reader = pair
    server.sendall(b"$10\r\nonly")
    server.close()
    with pytest.raises(ConnectionError):
        reader.bulk_into(bytearray(64))
