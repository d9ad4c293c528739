"""The types of the daemon's config keys: pydantic types whose Field description says what each allows.

Strict types (YAML's true is no integer, 16.0 no int) with pydantic's own constraints where it has them
(ranges, words); where it has none (byte sizes, socket modes, paths, device names, subsets) a check function
returns the stored value or raises Bad, whose hint the message carries. ``hmad.config`` builds its sections
from these and words pydantic's errors with the descriptions.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from decimal import Decimal
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, PlainSerializer, PlainValidator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from hmaclient.sampling import describe_range

UNIX_PATH_MAX = 107  # sun_path is 108 bytes with the terminating NUL


class Bad(Exception):
    """A value a check refused; ``hint`` is appended to the message."""

    def __init__(self, hint: str = ""):
        super().__init__(hint)
        self.hint = hint


def typed(tp: Any, says: str, *extra: Any) -> Any:
    """Type ``tp`` with pydantic constraints or validators ``extra``; ``says``: what it allows."""
    return Annotated[(tp, *extra, Field(description=says))]


def description_of(tp: Any) -> str:
    return next(m.description for m in tp.__metadata__ if isinstance(m, FieldInfo) and m.description)


def int_in(lo: int, hi: int | None = None) -> Any:
    return typed(int, describe_range("int", lo, hi), Field(ge=lo, le=hi))


def real_in(lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> Any:
    low = {} if lo is None else {"gt" if lo_open else "ge": lo}
    return typed(float, describe_range("real", lo, hi, lo_open), Field(**low, le=hi, allow_inf_nan=False))


def one_of(*words: str) -> Any:
    """One of a few words; case-insensitive, stored in lower case."""
    lower = BeforeValidator(lambda v: v.lower() if isinstance(v, str) else v)
    return typed(Literal[words], "one of " + ", ".join(words), lower)


def _tristate(v: Any) -> Any:
    words = {"auto": "auto", "true": True, "false": False}
    return words.get(v.lower(), v) if isinstance(v, str) else v


def power_of_two(v: int) -> int:
    if v & (v - 1):
        raise PydanticCustomError("hmad", "", {"hint": ""})
    return v


BOOL = typed(bool, "true or false")
TRISTATE = typed(Literal["auto"] | bool, "one of auto, true, false", BeforeValidator(_tristate))


def custom(tp: Any, says: str, check: Callable[[Any], Any], show: Callable[[Any], Any] | None = None) -> Any:
    """A key pydantic has no type for: ``check`` returns the stored value or raises Bad; ``show`` turns a
    stored value back into plain data (to_dict)."""

    def validate(v: Any) -> Any:
        try:
            return check(v)
        except Bad as bad:
            raise PydanticCustomError("hmad", "{hint}", {"hint": bad.hint}) from None

    extra = [PlainValidator(validate)] + ([PlainSerializer(show, when_used="json")] if show else [])
    return typed(tp, says, *extra)


def or_null(tp: Any, null_means: str) -> Any:
    return Annotated[tp | None, Field(description=f"{description_of(tp)}, or null ({null_means})")]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # YAML true is a bool, and bool is an int


def _is_scalar(v: Any) -> bool:
    return isinstance(v, int | float | bool)


def text(what: str = "a non-empty string") -> Any:
    def check(v: Any) -> str:
        if not isinstance(v, str) or not v.strip():
            raise Bad(" (quote it if YAML read it as a number or boolean)" if _is_scalar(v) else "")
        return v

    return custom(str, what, check)


def socket_path(v: Any) -> str:
    if not isinstance(v, str) or not os.path.isabs(v):
        raise Bad()
    if len(os.fsencode(v)) > UNIX_PATH_MAX:
        raise Bad(f" ({len(os.fsencode(v))} bytes: longer than a Unix socket path can be)")
    return v


_MODE_RE = re.compile(r"(0o|0)?([0-7]{3})")


def mode_bits(v: Any) -> int:
    """Permission bits of the socket, 0o000..0o777: an int (YAML reads unquoted 0660 as octal) or "0660"."""
    if _is_int(v):
        if 0 <= v <= 0o777:
            return v
        digits = str(v)
        raise Bad(f" (= {v:#o}; did you mean '0{digits}'?)" if _MODE_RE.fullmatch(digits) else "")
    m = _MODE_RE.fullmatch(v) if isinstance(v, str) else None
    if m is None:
        raise Bad()
    return int(m.group(2), 8)


_BYTE_UNITS = {
    "": 1, "b": 1,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}  # fmt: skip
_BYTES_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")


def parse_bytes(v: Any) -> int:
    """A byte size: an int, or a string such as "8GiB", "512 MiB", "1.5GiB", "4MB" (units: B, KiB, MiB,
    GiB, TiB binary; kB, MB, GB, TB decimal; case-insensitive). Raises ValueError for anything else."""
    if _is_int(v) and v >= 0:
        return v
    m = _BYTES_RE.fullmatch(v) if isinstance(v, str) else None
    if m is None or m.group(2).lower() not in _BYTE_UNITS:
        raise ValueError(f"not a byte size: {v!r}")
    n = Decimal(m.group(1)) * _BYTE_UNITS[m.group(2).lower()]
    if n != n.to_integral_value():
        raise ValueError(f"not a whole number of bytes: {v!r}")
    return int(n)


def _iec(n: int) -> str:
    """1073741824 -> '1GiB' (the largest binary unit that divides n)."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if n and n % _BYTE_UNITS[unit.lower()] == 0:
            return f"{n // _BYTE_UNITS[unit.lower()]}{unit}"
    return str(n)


def byte_size(lo: int = 0, hi: int | None = None) -> Any:
    def check(v: Any) -> int:
        try:
            n = parse_bytes(v)
        except ValueError:
            raise Bad() from None
        if n < lo or (hi is not None and n > hi):
            raise Bad(f" (= {n} bytes)")
        return n

    span = f" from {_iec(lo)} to {_iec(hi)}" if hi is not None else ""
    units = "(units B, KiB, MiB, GiB, TiB, kB, MB, GB, TB)"
    return custom(int, f"a byte size{span}: an integer, or a string like '512MiB' or '8GiB' {units}", check)


def device(v: Any) -> int | str | None:
    if v is None or (_is_int(v) and v >= 0) or (isinstance(v, str) and v.strip()):
        return v
    raise Bad()


def subset(known: tuple[str, ...]) -> Any:
    """A list of distinct words from ``known``; stored as a tuple."""

    def check(v: Any) -> tuple[str, ...]:
        if not isinstance(v, list | tuple):
            raise Bad()
        bad = [x for x in v if x not in known]
        if bad:
            raise Bad(f" (unknown: {', '.join(map(show, bad))})")
        if len(set(v)) != len(v):
            raise Bad(" (a name is repeated)")
        return tuple(v)

    return custom(tuple[str, ...], "a list of distinct names from " + ", ".join(known), check, show=list)


def absolute_path(what: str) -> Any:
    """An absolute path (a file the daemon or its children open; a relative one would depend on the
    working directory, / under systemd)."""

    def check(v: Any) -> str:
        if not isinstance(v, str) or not os.path.isabs(v):
            raise Bad()
        return v

    return custom(str, f"the absolute path of {what}", check)


def texts(what: str) -> Any:
    """A list of distinct non-empty strings; stored as a tuple."""

    def check(v: Any) -> tuple[str, ...]:
        if not isinstance(v, list | tuple) or not all(isinstance(x, str) and x.strip() for x in v):
            raise Bad()
        if len(set(v)) != len(v):
            raise Bad(" (a name is repeated)")
        return tuple(v)

    return custom(tuple[str, ...], f"a list of {what}", check, show=list)


def show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."
