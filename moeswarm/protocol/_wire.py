"""msgpack at the edge: the canonical encoder, the defensive decoder and typed field reads.

``unpack`` turns any bytes into plain Python values or raises ``ProtocolError`` (code 1);
``Fields`` reads typed, range-checked values out of one received map (code 4 on failure).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, NoReturn

import msgpack

from moeswarm.errors import ConfigError, ProtocolError

from ._limits import U64_MAX, ErrorCode

_Timestamp = msgpack.Timestamp


# ---------------------------------------------------------------- canonical encoding


def sorted_map(items: Mapping[str, Any]) -> dict[str, Any]:
    """A dict whose insertion order is the canonical key order (UTF-8 bytes, ascending)."""
    return {k: items[k] for k in sorted(items, key=lambda k: k.encode("utf-8"))}


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


def unpack(body: bytes) -> Any:
    """Decode exactly one msgpack object spanning all of ``body``; no ext types, str keys."""
    try:
        obj = msgpack.unpackb(
            body,
            raw=False,
            use_list=True,
            strict_map_key=False,
            object_pairs_hook=_pairs_hook,
            list_hook=_list_hook,
            ext_hook=_ext_hook,
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
