"""msgpack at the edge: the canonical encoder, the defensive decoder and typed field reads.

``unpack`` turns any bytes into plain Python values or raises ``ProtocolError`` (code 1);
``Fields`` reads typed, range-checked values out of one received map (code 4 on failure).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import msgpack

from moeswarm.errors import ConfigError, ProtocolError

from ._limits import (
    DEFAULT_MAX_FRAME,
    MAX_DECODE_DEPTH,
    MAX_DECODE_MAP,
    MAX_DECODE_OBJECTS,
    MAX_DECODE_STR,
    MAX_EXPERTS_PER_REQUEST,
    U64_MAX,
    ErrorCode,
)

_Timestamp = msgpack.Timestamp


# ---------------------------------------------------------------- canonical encoding


def sorted_map(items: Mapping[str, Any]) -> dict[str, Any]:
    """A dict whose insertion order is the canonical key order (UTF-8 bytes, ascending): the order
    of the keys' code points, which is how Python compares ``str`` (UTF-8 keeps code point order)."""
    return {k: items[k] for k in sorted(items)}


def _canon(obj: Any) -> Any:
    if obj is None or isinstance(obj, (bool, int, str, bytes, float)):
        return obj
    if isinstance(obj, (bytearray, memoryview)):
        return bytes(obj)
    if isinstance(obj, Mapping):
        if not all(isinstance(k, str) for k in obj):
            raise ConfigError("canonical msgpack maps take string keys only")
        return {k: _canon(v) for k, v in sorted_map(obj).items()}
    if isinstance(obj, (list, tuple)):
        return [_canon(v) for v in obj]
    raise ConfigError(f"cannot encode {type(obj).__name__} in canonical msgpack")


def canonical(obj: Any) -> bytes:
    """The canonical msgpack encoding of ``obj`` (spec section "Canonical encoding").

    Maps are sorted by the UTF-8 bytes of their keys, every integer and header takes its
    shortest form, bytes are ``bin`` and text is ``str``, floats are float64.
    """
    try:
        out: bytes = msgpack.packb(_canon(obj), use_bin_type=True)
    except (OverflowError, UnicodeEncodeError, ValueError, TypeError) as exc:
        raise ConfigError(f"cannot encode value: {exc}") from exc
    return out


def pack(obj: Any) -> bytes:
    """Encode an object whose maps were already built in canonical order (``sorted_map``)."""
    try:
        out: bytes = msgpack.packb(obj, use_bin_type=True)
    except (OverflowError, UnicodeEncodeError, ValueError, TypeError) as exc:
        raise ConfigError(f"cannot encode message: {exc}") from exc
    return out


LARGE_BIN = 512 << 10
"""Bytes from which ``pack_parts`` leaves a ``bin``'s payload where it is instead of copying it."""


def _container_header(n: int, fix: int, b16: int, b32: int) -> bytes:
    if n <= 15:
        return bytes((fix | n,))
    return bytes((b16,)) + n.to_bytes(2, "big") if n < 2**16 else bytes((b32,)) + n.to_bytes(4, "big")


def _bin_header(n: int) -> bytes:
    if n < 2**8:
        return b"\xc4" + n.to_bytes(1, "big")
    return b"\xc5" + n.to_bytes(2, "big") if n < 2**16 else b"\xc6" + n.to_bytes(4, "big")


def pack_parts(obj: Any, parts: list[bytes | memoryview]) -> None:
    """Append to ``parts`` pieces whose concatenation is ``pack(obj)``: each ``bin`` of at least
    ``LARGE_BIN`` bytes given as a memoryview is appended as it is (a tensor's own memory), so a
    frame is assembled with one copy of it (``frame``) instead of three."""
    if type(obj) is dict:
        parts.append(_container_header(len(obj), 0x80, 0xDE, 0xDF))
        for key, value in obj.items():
            parts.append(pack(key))
            pack_parts(value, parts)
    elif type(obj) is list:
        parts.append(_container_header(len(obj), 0x90, 0xDC, 0xDD))
        for value in obj:
            pack_parts(value, parts)
    elif type(obj) is memoryview and obj.nbytes >= LARGE_BIN:
        parts.append(_bin_header(obj.nbytes))
        parts.append(obj.cast("B"))
    else:
        parts.append(pack(obj))


# ---------------------------------------------------------------- defensive decoding


def _malformed(message: str) -> NoReturn:
    raise ProtocolError(message, code=ErrorCode.MALFORMED_FRAME)


def _pairs_hook(pairs: list[tuple[Any, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if type(key) is not str:
            _malformed("map key is not a string")
        if key in out:
            _malformed(f"duplicate map key {key!r}")
        if type(value) is _Timestamp:
            _malformed("ext types are not allowed")
        out[key] = value
    return out


def _list_hook(items: list[Any]) -> list[Any]:
    if _Timestamp in set(map(type, items)):
        _malformed("ext types are not allowed")
    return items


def _ext_hook(code: int, data: bytes) -> NoReturn:
    _malformed(f"ext type {code} is not allowed")


@dataclass(frozen=True)
class DecodeLimits:
    """What one decoded body may contain. Checked on the bytes before any Python object is built,
    so a body costs at most ``max_objects`` small objects plus its own size in str/bin copies."""

    max_depth: int = MAX_DECODE_DEPTH  # nesting of arrays and maps
    max_objects: int = MAX_DECODE_OBJECTS  # values, keys and containers together
    max_array: int = MAX_EXPERTS_PER_REQUEST  # items of one array
    max_map: int = MAX_DECODE_MAP  # entries of one map
    max_str: int = MAX_DECODE_STR  # bytes of one str
    max_bin: int = DEFAULT_MAX_FRAME  # bytes of one bin


DEFAULT_LIMITS = DecodeLimits()

# msgpack first bytes -> (kind, size of the length or value that follows). Kinds: "v" a value of
# that many bytes, "s"/"b" str/bin whose length takes that many bytes, "a"/"m" array/map likewise.
_HEADERS: dict[int, tuple[str, int]] = {
    0xC0: ("v", 0), 0xC2: ("v", 0), 0xC3: ("v", 0),
    0xC4: ("b", 1), 0xC5: ("b", 2), 0xC6: ("b", 4),
    0xCA: ("v", 4), 0xCB: ("v", 8),
    0xCC: ("v", 1), 0xCD: ("v", 2), 0xCE: ("v", 4), 0xCF: ("v", 8),
    0xD0: ("v", 1), 0xD1: ("v", 2), 0xD2: ("v", 4), 0xD3: ("v", 8),
    0xD9: ("s", 1), 0xDA: ("s", 2), 0xDB: ("s", 4),
    0xDC: ("a", 2), 0xDD: ("a", 4), 0xDE: ("m", 2), 0xDF: ("m", 4),
}


def scan(body: bytes, limits: DecodeLimits = DEFAULT_LIMITS) -> None:
    """Walk the msgpack headers of ``body`` (str and bin contents are skipped, not read) and raise
    ``ProtocolError`` code 1 unless it is exactly one object within ``limits``. Costs one step per
    object, never more than ``limits.max_objects`` steps."""
    n, pos, objects = len(body), 0, 0
    stack: list[int] = []  # items still due in each open container
    due = 1  # items still due at the current level
    max_objects, max_depth = limits.max_objects, limits.max_depth
    while True:
        if due == 0:
            if not stack:
                break
            due = stack.pop()
            continue
        if pos >= n:
            _malformed("truncated msgpack body")
        b = body[pos]
        pos += 1
        due -= 1
        objects += 1
        if objects > max_objects:
            _malformed(f"more than {max_objects} msgpack objects")
        if b <= 0x7F or b >= 0xE0:
            continue
        if b <= 0x8F:
            kind, count = "m", b & 0x0F
        elif b <= 0x9F:
            kind, count = "a", b & 0x0F
        elif b <= 0xBF:
            if b & 0x1F > limits.max_str:
                _malformed(f"a str longer than {limits.max_str} bytes")
            pos += b & 0x1F
            continue
        else:
            header = _HEADERS.get(b)
            if header is None:
                _malformed("ext types are not allowed" if b in (0xC7, 0xC8, 0xC9) or 0xD4 <= b <= 0xD8
                           else f"invalid msgpack byte 0x{b:02x}")
            kind, size = header
            if kind == "v":
                pos += size
                continue
            if pos + size > n:
                _malformed("truncated msgpack body")
            count = int.from_bytes(body[pos:pos + size], "big")
            pos += size
            if kind == "s" or kind == "b":
                limit = limits.max_str if kind == "s" else limits.max_bin
                if count > limit:
                    _malformed(f"a {'str' if kind == 's' else 'bin'} of {count} bytes exceeds {limit}")
                pos += count
                continue
        if kind == "a":
            if count > limits.max_array:
                _malformed(f"an array of {count} items exceeds {limits.max_array}")
        else:
            if count > limits.max_map:
                _malformed(f"a map of {count} entries exceeds {limits.max_map}")
            count *= 2
        if count:
            stack.append(due)
            if len(stack) > max_depth:
                _malformed(f"nested deeper than {max_depth}")
            due = count
    if pos != n:
        _malformed("truncated msgpack body" if pos > n else "trailing bytes after the msgpack object")


def unpack(body: bytes, limits: DecodeLimits = DEFAULT_LIMITS) -> Any:
    """Decode exactly one msgpack object spanning all of ``body``; no ext types, str keys, and
    nothing beyond ``limits`` (checked by ``scan`` before decoding)."""
    scan(body, limits)
    try:
        obj = msgpack.unpackb(
            body,
            raw=False,
            use_list=True,
            strict_map_key=False,
            object_pairs_hook=_pairs_hook,
            list_hook=_list_hook,
            ext_hook=_ext_hook,
            max_str_len=limits.max_str,
            max_bin_len=limits.max_bin,
            max_array_len=limits.max_array,
            max_map_len=limits.max_map,
            max_ext_len=0,
        )
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises a zoo: ExtraData, FormatError, StackError, ...
        raise ProtocolError(f"not one msgpack object: {exc}", code=ErrorCode.MALFORMED_FRAME) from None
    if type(obj) is _Timestamp:
        _malformed("ext types are not allowed")
    return obj


# ---------------------------------------------------------------- typed field reads


def bad(message: str, code: int = ErrorCode.BAD_FIELD) -> NoReturn:
    raise ProtocolError(message, code=code)


class Fields:
    """Typed reads from one received map. ``where`` names the map in error messages.

    Unknown keys are ignored. A missing or ``nil`` optional field reads as ``None``.
    """

    __slots__ = ("_m", "_where")

    def __init__(self, m: Any, where: str) -> None:
        if type(m) is not dict:
            bad(f"{where} is not a map")
        self._m: dict[str, Any] = m
        self._where = where

    def _name(self, name: str) -> str:
        return f"{self._where}.{name}"

    def raw(self, name: str) -> Any:
        if name not in self._m:
            bad(f"{self._name(name)} is missing")
        return self._m[name]

    def has(self, name: str) -> bool:
        return self._m.get(name) is not None

    def uint(self, name: str, *, lo: int = 0, hi: int = U64_MAX) -> int:
        return check_uint(self.raw(name), self._name(name), lo=lo, hi=hi)

    def opt_uint(self, name: str, *, lo: int = 0, hi: int = U64_MAX) -> int | None:
        return self.uint(name, lo=lo, hi=hi) if self.has(name) else None

    def bin(self, name: str, *, size: int | None = None, max_size: int | None = None) -> bytes:
        value = self.raw(name)
        if type(value) is not bytes:
            bad(f"{self._name(name)} is not bin")
        if size is not None and len(value) != size:
            bad(f"{self._name(name)} must be {size} bytes, not {len(value)}")
        if max_size is not None and len(value) > max_size:
            bad(f"{self._name(name)} is longer than {max_size} bytes")
        return value

    def opt_bin(self, name: str, *, size: int | None = None) -> bytes | None:
        return self.bin(name, size=size) if self.has(name) else None

    def text(self, name: str, *, max_bytes: int, pattern: re.Pattern[str] | None = None) -> str:
        return check_text(self.raw(name), self._name(name), max_bytes=max_bytes, pattern=pattern)

    def array(self, name: str, *, lo: int, hi: int) -> list[Any]:
        value = self.raw(name)
        if type(value) is not list:
            bad(f"{self._name(name)} is not an array")
        if not lo <= len(value) <= hi:
            bad(f"{self._name(name)} must hold {lo}..{hi} items, not {len(value)}")
        return value

    def map(self, name: str) -> Fields:
        return Fields(self.raw(name), self._name(name))


def check_uint(value: Any, name: str, *, lo: int = 0, hi: int = U64_MAX) -> int:
    """An integer (not a bool) within ``lo..hi`` inclusive."""
    if type(value) is not int:
        bad(f"{name} is not an integer")
    if not lo <= value <= hi:
        bad(f"{name} = {value} is outside {lo}..{hi}")
    return value


def check_text(
    value: Any, name: str, *, max_bytes: int, pattern: re.Pattern[str] | None = None
) -> str:
    """A str of at most ``max_bytes`` UTF-8 bytes, matching ``pattern`` when given."""
    if type(value) is not str:
        bad(f"{name} is not a string")
    if len(value.encode("utf-8", "surrogatepass")) > max_bytes:
        bad(f"{name} is longer than {max_bytes} bytes")
    if pattern is not None and pattern.fullmatch(value) is None:
        bad(f"{name} = {value!r} does not match {pattern.pattern}")
    return value
