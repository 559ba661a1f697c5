"""Commands streamed to Redis over pooled connections, their replies read straight from the socket.

The Redis tier reads blocks of megabytes. Through redis-py each block would be copied twice before the tier could
verify it (hiredis gathers the reply into a buffer of its own, then makes a bytes object of it), and a pipeline of a
whole chain makes Redis build every reply in its memory before it sends the first byte: at 4k tokens, 189 MB copied,
paged in and sent late. A `CommandStream` reads each reply straight into a buffer the caller owns and keeps only a
few commands in flight, sending the next as a reply comes in, so Redis builds one reply while the last is on the
wire, and the whole read still costs one round trip of latency.

redis-py still does everything else: connecting, TLS, authentication, the database, and a cluster's slots. The
stream borrows a connection per node from redis-py's pools, writes commands it packed, and reads the socket itself:
redis-py offers no way to read a reply into the caller's buffer.
"""

from __future__ import annotations

from collections import deque
from types import TracebackType
from typing import TypeVar

import redis
from redis.cluster import RedisCluster
from redis.connection import Connection
from redis.exceptions import InvalidResponse

_T = TypeVar("_T")
_READ_AHEAD = 64 << 10  # bytes read at once for reply headers and small replies
_SMALL_BYTES = 1 << 20  # the largest bulk string `read` returns: the replies it reads are lists of token ids


class ReplyError(Exception):
    """An error reply from Redis, such as WRONGTYPE or a cluster's MOVED, returned in place of the reply."""


class CommandStream:
    """Commands sent in order, over one connection per Redis node, and their replies read back in the same order.

    `send` queues a command; the queue goes out in one write when the next reply is read, so commands sent together
    arrive together. Closing the stream drains replies still in flight and gives the connections back; after a
    failure (a timeout, a dropped connection, a malformed reply) it disconnects them instead, since their replies are
    out of step.
    """

    def __init__(self, client: redis.Redis | RedisCluster) -> None:
        self._client = client
        self._connections: dict[str, _Connection] = {}  # by node
        self._pending: deque[_Connection] = deque()  # the connection of each command whose reply is not read yet
        self.moved = False  # a cluster node answered MOVED: the client's map of slots is out of date

    def __enter__(self) -> CommandStream:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close(failed=error is not None)

    def send(self, *command: str | int | bytes) -> None:
        """Queue a command; its second word, the key, picks the node."""
        connection = self._connection(command[1])
        connection.queue(command)
        self._pending.append(connection)

    def read(self) -> object:
        """Return the next reply: bytes, int, list, None, or a ReplyError (an OversizeValue for a bulk string over
        `_SMALL_BYTES`, read through and dropped)."""
        return self._seen(self._next().reply())

    def read_into(self, buffer: bytearray) -> memoryview | ReplyError | None:
        """Return the next reply, a bulk string, read into `buffer`: a view of its leading bytes.

        A value longer than `buffer` is read through and dropped, an `OversizeValue`: a block's value has a known size,
        and a larger one must not make a lookup take memory without bound.
        """
        return self._seen(self._next().bulk_into(buffer))

    def close(self, *, failed: bool = False) -> None:
        """Give the connections back: drained of replies still in flight, or disconnected when `failed`."""
        try:
            while self._pending and not failed:
                self._next().reply()  # a block's value is read through and dropped, never held whole
        except BaseException:
            failed = True
            raise
        finally:
            for connection in self._connections.values():
                connection.release(failed)
            self._connections.clear()
            self._pending.clear()

    def _seen(self, reply: _T) -> _T:
        if isinstance(reply, ReplyError) and str(reply).startswith("MOVED "):
            self.moved = True
        return reply

    def _next(self) -> _Reader:
        for connection in self._connections.values():  # every node's commands go out before waiting on one node
            connection.flush()
        return self._pending.popleft().reader

    def _connection(self, key: str | int | bytes) -> _Connection:
        client = self._client
        if isinstance(client, RedisCluster):
            node = client.get_node_from_key(key)  # type: ignore[no-untyped-call]
            name, pool = node.name, client.get_redis_connection(node).connection_pool
        else:
            name, pool = "", client.connection_pool
        if name not in self._connections:
            self._connections[name] = _Connection(pool)
        return self._connections[name]


class OversizeValue(ReplyError):
    """A bulk reply larger than the buffer it was to be read into; its bytes were read and dropped."""


class _Connection:
    """A connection borrowed from a pool, with the commands queued for it and the reader of its socket."""

    def __init__(self, pool: redis.ConnectionPool) -> None:
        self._pool = pool
        self._connection: Connection = pool.get_connection()
        self._queued: list[bytes] = []
        try:
            sock = self._connection._sock  # connected by `get_connection`
            assert sock is not None
        except BaseException:
            pool.release(self._connection)
            raise
        self.reader: _Reader = _Reader(sock)

    def queue(self, command: tuple[str | int | bytes, ...]) -> None:
        self._queued += self._connection.pack_command(*command)  # type: ignore[no-untyped-call]

    def flush(self) -> None:
        if self._queued:
            # One write: redis-py would send each packed piece with a call of its own, and Redis read them apart.
            self._connection.send_packed_command([b"".join(self._queued)], check_health=False)  # type: ignore[no-untyped-call]
            self._queued = []

    def release(self, failed: bool) -> None:
        if failed:
            self._connection.disconnect()  # type: ignore[no-untyped-call]
        self._pool.release(self._connection)


class _Reader:
    """RESP replies read from a socket, with a small read-ahead buffer; bulk strings land in the caller's buffer."""

    def __init__(self, sock: object) -> None:
        self._sock = sock
        self._buffer = bytearray(_READ_AHEAD)
        self._start = 0  # bytes read ahead: self._buffer[self._start : self._end]
        self._end = 0

    def reply(self) -> object:
        """Return the next reply; a bulk string over `_SMALL_BYTES` is read through and dropped, an OversizeValue."""
        return self._rest_of_reply(*self._header())

    def bulk_into(self, buffer: bytearray) -> memoryview | ReplyError | None:
        """Return the next reply, a bulk string, read into `buffer`; any other reply is read whole and stands as a
        ReplyError (None stays None)."""
        kind, rest = self._header()
        if kind == b"$":
            return self._bulk(_integer(rest), buffer)
        other = self._rest_of_reply(kind, rest)
        return other if other is None or isinstance(other, ReplyError) else ReplyError(f"not a value: {other!r}")

    def _rest_of_reply(self, kind: bytes, rest: bytes) -> object:
        """Return the reply whose first line was `kind` and `rest`."""
        if kind == b"$":
            value = self._bulk(_integer(rest), None)
            return bytes(value) if isinstance(value, memoryview) else value
        if kind == b"*":
            count = _integer(rest)
            return None if count < 0 else [self.reply() for _ in range(count)]
        if kind == b":":
            return _integer(rest)
        if kind == b"-":
            return ReplyError(rest.decode(errors="replace"))
        if kind == b"+":
            return bytes(rest)
        if kind == b"_":  # RESP3's null
            return None
        raise InvalidResponse(f"unexpected reply type {kind!r} from Redis")

    def _bulk(self, length: int, buffer: bytearray | None) -> memoryview | OversizeValue | None:
        """Read a bulk string's bytes into `buffer` (a new one when None) and return a view of them."""
        if length < 0:
            return None
        if buffer is None and length <= _SMALL_BYTES:
            buffer = bytearray(length + 2)
        if buffer is None or length + 2 > len(buffer):
            scratch = memoryview(bytearray(min(length + 2, _READ_AHEAD)))
            left = length + 2
            while left:
                step = min(left, len(scratch))
                self._read_exactly(scratch[:step])
                left -= step
            expected = _SMALL_BYTES if buffer is None else len(buffer) - 2
            return OversizeValue(f"a value of {length} bytes, more than the {expected} expected")
        view = memoryview(buffer)[: length + 2]
        self._read_exactly(view)
        if bytes(view[length:]) != b"\r\n":
            raise InvalidResponse("a bulk reply from Redis not ended by CRLF")
        return view[:length]

    def _header(self) -> tuple[bytes, bytes]:
        """Return the type byte and the rest of the next reply's first line, past any RESP3 push message."""
        kind, rest = self._line()
        while kind == b">":  # out-of-band (client tracking, maintenance notices): not a reply to a command
            for _ in range(_integer(rest)):
                self.reply()
            kind, rest = self._line()
        return kind, rest

    def _line(self) -> tuple[bytes, bytes]:
        while True:
            end = self._buffer.find(b"\r\n", self._start, self._end)
            if end >= 0:
                line = bytes(self._buffer[self._start : end])
                self._start = end + 2
                if not line:
                    raise InvalidResponse("an empty line from Redis")
                return line[:1], line[1:]
            if self._start == 0 and self._end == len(self._buffer):
                raise InvalidResponse(f"a reply line longer than {len(self._buffer)} bytes from Redis")
            self._fill()

    def _read_exactly(self, into: memoryview) -> None:
        """Fill `into` with the next bytes: those read ahead first, then straight from the socket."""
        ahead = min(len(into), self._end - self._start)
        into[:ahead] = self._buffer[self._start : self._start + ahead]
        self._start += ahead
        done = ahead
        while done < len(into):
            done += self._receive(into[done:])

    def _fill(self) -> None:
        """Read more bytes after those read ahead, moving them to the front first."""
        if self._start:
            left = self._end - self._start
            self._buffer[:left] = self._buffer[self._start : self._end]
            self._start, self._end = 0, left
        self._end += self._receive(memoryview(self._buffer)[self._end :])

    def _receive(self, into: memoryview) -> int:
        count: int = self._sock.recv_into(into)  # type: ignore[attr-defined]
        if count == 0:
            raise ConnectionError("Redis closed the connection")
        return count


def _integer(text: bytes) -> int:
    try:
        return int(text)
    except ValueError:
        raise InvalidResponse(f"a malformed length or number {text[:32]!r} from Redis") from None
