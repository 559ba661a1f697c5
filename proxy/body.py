"""Request bodies: JSON decoded, checked and validated so that no body holds the event loop.

A body past `OFF_LOOP_BYTES` is handled in a worker thread, and in pieces: the decoder and the validator are C and
Rust calls that keep the GIL for as long as they run, so one call over a 16 MiB body would stall the loop for the
whole of it (measured: half a second to validate 200,000 messages at once) even from another thread. Decoded value by
value and validated 256 list items at a time, each call is short, and the loop gets the GIL between them; the
garbage collector, which would walk all of a large body's objects at once, is held off (`_collector_held_off`).
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import threading
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError

from prefixgate.errors import RequestError

_Body = TypeVar("_Body", bound=BaseModel)
_Parsed = TypeVar("_Parsed")

MAX_JSON_DEPTH = 64  # lists and objects within each other; real tool schemas nest a dozen levels at most
OFF_LOOP_BYTES = 64 << 10  # smaller bodies are handled on the loop: a thread's hand-off would cost more
_PIECE_CHARACTERS = 1 << 20  # a top-level value longer than this is decoded item by item when it is a list
_ITEMS = 256  # list items validated per call
_FREED = 4096  # list items let go of per call
_DIGITS = 1000  # the most digits an integer may have (Python's own limit, 4,300, raises an error meant for programmers)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number; send a number or null")


def _integer(digits: str) -> int:
    if len(digits) > _DIGITS:
        raise ValueError(f"an integer of {len(digits)} digits; at most {_DIGITS} are accepted")
    return int(digits)


def _finite(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"the number {text[:20]}{'...' if len(text) > 20 else ''} is too large")
    return number


# Strict JSON: Python's decoder also takes NaN and Infinity, and reads 1e400 as infinity, none of which JSON can hold.
_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_int=_integer, parse_float=_finite)


async def parsed(raw: bytes, model: type[_Body]) -> _Body:
    """Return a JSON request body validated as `model`, handled off the loop past `OFF_LOOP_BYTES`; raise
    RequestError (or pydantic's ValidationError) saying what is wrong with it."""
    if len(raw) <= OFF_LOOP_BYTES:
        return parse_json(raw, model)
    return await off_loop(parse_json, raw, model)


async def parsed_object(raw: bytes) -> dict[str, Any]:
    """Return a request body's JSON object, decoded and checked off the loop past `OFF_LOOP_BYTES`."""
    if len(raw) <= OFF_LOOP_BYTES:
        return json_object(raw)
    return await off_loop(json_object, raw)


async def off_loop(work: Callable[..., _Parsed], *args: Any) -> _Parsed:
    """Return `work(*args)`, run as a large body's parsing is: in a worker thread, the garbage collector held off."""
    return await asyncio.to_thread(_collector_held_off, work, *args)


_LARGE_BODY = threading.Lock()  # one large body at a time holds the cyclic garbage collector off


def _collector_held_off(parse: Callable[..., _Parsed], *args: Any) -> _Parsed:
    """Run `parse` with Python's cyclic garbage collector held off, and keep it off the objects `parse` made.

    Millions of small objects (a body of 400,000 messages) set off full collections, each a pass over every object
    with the GIL held: the loop stalled 130 ms at a time, against 34 ms without (benchmarks/body_bench.py). So the
    collector is off while the body is decoded, and at the end every object alive is frozen (`gc.freeze`: left out
    of collections; reference counting still frees them) until the next large body unfreezes them, instead of one
    collection walking all of them at once.
    """
    with _LARGE_BODY:
        gc.unfreeze()
        gc.disable()
        try:
            return parse(*args)
        finally:
            gc.freeze()
            gc.enable()


def let_go(items: list[Any]) -> None:
    """Empty a large body's list a slice at a time (blocking; call it off the loop): freeing what it holds is then
    many short calls, between which the loop gets the GIL, instead of one that holds it for all of them."""
    while items:
        del items[-_FREED:]


def parse_json(raw: bytes, model: type[_Body]) -> _Body:
    """Return a JSON request body validated as `model` (blocking; see `parsed`)."""
    data = json_object(raw)
    for name, field in model.model_fields.items():
        item = _list_item_model(field.annotation)
        value = data.get(name)
        if item is not None and isinstance(value, list) and len(value) > _ITEMS:
            try:
                data[name] = _validated_items(name, value, item)
            finally:
                let_go(value)  # here, not on the loop where a refusal's traceback would free it
    return model.model_validate(data)


def json_object(raw: bytes) -> dict[str, Any]:
    """Return a request body's JSON object; raise RequestError when it is not one, nests more than `MAX_JSON_DEPTH`
    levels, or holds text that is no text (blocking; see `parsed_object`)."""
    try:
        data = _decode(raw.decode("utf-8"))
    except ValueError as error:  # json.JSONDecodeError and UnicodeDecodeError among them
        raise RequestError(f"the request body is not valid JSON: {error}") from None
    except RecursionError:
        raise RequestError(f"the request body nests too deeply; at most {MAX_JSON_DEPTH} levels are accepted") from None
    if not isinstance(data, dict):
        raise RequestError("the request body must be a JSON object")
    _check_values(data)
    return data


def _decode(text: str) -> Any:
    """Return the JSON value of `text`, decoding a large object's values one by one, and a large list's items one by
    one."""
    if len(text) <= _PIECE_CHARACTERS:
        return _DECODER.decode(text)
    at = _skip(text, 0)
    if not text.startswith("{", at):
        return _DECODER.decode(text)  # not an object: refused as soon as it is decoded
    result: dict[str, Any] = {}
    at = _skip(text, at + 1)
    while not text.startswith("}", at):
        if result:
            at = _skip(text, _expect(text, at, ","))
        if not text.startswith('"', at):
            raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, at)
        key, at = json.decoder.scanstring(text, at + 1)  # type: ignore[attr-defined]
        at = _skip(text, _expect(text, _skip(text, at), ":"))
        if text.startswith("[", at):
            result[key], at = _list(text, at)
        else:
            result[key], at = _DECODER.raw_decode(text, at)
        at = _skip(text, at)
    if _skip(text, at + 1) != len(text):
        raise json.JSONDecodeError("Extra data", text, _skip(text, at + 1))
    return result


def _list(text: str, at: int) -> tuple[list[Any], int]:
    """Decode the list at `text[at]` item by item; return it and where it ends."""
    items: list[Any] = []
    at = _skip(text, at + 1)
    while not text.startswith("]", at):
        if items:
            at = _skip(text, _expect(text, at, ","))
        item, at = _DECODER.raw_decode(text, at)
        items.append(item)
        at = _skip(text, at)
    return items, at + 1


def _skip(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\n\r":
        at += 1
    return at


def _expect(text: str, at: int, character: str) -> int:
    if not text.startswith(character, at):
        raise json.JSONDecodeError(f"Expecting {character!r} delimiter", text, at)
    return at + 1


def _check_values(body: dict[str, Any]) -> None:
    """Refuse a body that nests too deeply or holds text no encoder takes (a lone surrogate, `"\\ud800"`: valid JSON,
    but no UTF-8 text), naming where; without recursion, linear in the body's size."""
    # Every later step (validation, canonical tool JSON, the chat template, the tokenizer) walks or encodes the text.
    pending: list[tuple[Any, int, str]] = [(body, 1, "")]
    while pending:
        item, depth, path = pending.pop()
        if isinstance(item, str):
            _encodable(item, path)
        elif isinstance(item, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise RequestError(f"the request body nests too deeply; at most {MAX_JSON_DEPTH} levels are accepted")
            entries = item.items() if isinstance(item, dict) else enumerate(item)
            for key, child in entries:
                name = f"{path}.{key}" if path else str(key)
                if isinstance(key, str):
                    _encodable(key, name)
                pending.append((child, depth + 1, name))


def _encodable(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise RequestError(
            f"{path or 'the body'} holds a lone surrogate (\\u{ord(text[error.start]):04x}), which is no text; send "
            "valid UTF-16 pairs or the character itself",
            param=path or None,
        ) from None


def _list_item_model(annotation: Any) -> type[BaseModel] | None:
    """Return `M` for a field annotated `list[M]` (or `list[M] | None`), M a pydantic model; else None."""
    options = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    for option in options:
        if typing.get_origin(option) is list:
            (item,) = typing.get_args(option)
            if isinstance(item, type) and issubclass(item, BaseModel):
                return item
    return None


def _validated_items(name: str, items: list[Any], model: type[BaseModel]) -> list[BaseModel]:
    """Validate a long list `_ITEMS` items a call; an error names the item's place in the whole list."""
    adapter = TypeAdapter(list[model])  # type: ignore[valid-type]
    validated: list[BaseModel] = []
    for start in range(0, len(items), _ITEMS):
        try:
            validated += adapter.validate_python(items[start : start + _ITEMS])
        except ValidationError as error:
            problems = [
                {key: problem[key] for key in ("type", "input", "ctx") if key in problem}
                | {"loc": (name, start + int(problem["loc"][0]), *problem["loc"][1:])}
                for problem in error.errors()
            ]
            let_go(validated)  # the traceback keeps this frame: what it validated is let go of here
            raise ValidationError.from_exception_data(error.title, problems) from None  # type: ignore[arg-type]
    return validated
