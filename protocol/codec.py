"""msgpack with hard limits: size before decoding, no ext types, no trailing bytes, bounded depth, finite floats.

`safe_unpack` is the only way bytes from a peer become Python objects. It never raises;
it returns a `Verdict` and, when accepted, the decoded object, which contains only
None, bool, int, float (finite), str, bytes, list and dict with str/bytes keys.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sized
from typing import Any, TypeVar

import msgpack

from .verdict import Reason, Verdict

T = TypeVar("T", bound=Sized)

_SCALARS = (type(None), bool, int, str, bytes)


def pack(obj: Any) -> bytes:
    """Encode `obj` as msgpack (bytes as bin, str as str); floats are always float64."""
    return msgpack.packb(obj, use_bin_type=True)


def _reject_ext(code: int, data: bytes) -> Any:
    # No message of ours uses ext types; refusing them keeps decoded objects to plain types.
    raise _ExtTypeRefused(f"msgpack ext type {code} is not allowed")


class _ExtTypeRefused(Exception):
    pass


class TooManyItems(Exception):
    """A message holds more arrays, maps and entries than its `counting_hook`'s budget."""


def counting_hook(budget: int) -> Callable[[T], T]:
    """A msgpack ``list_hook`` / ``object_hook`` that counts each container and its entries as it is decoded and
    raises `TooManyItems` past `budget`: 4 MiB of one-byte empty maps is 4 million Python objects (570 MiB, seconds
    of CPU) before any schema check could refuse them."""
    left = budget

    def count(container: T) -> T:
        nonlocal left
        left -= 1 + len(container)  # an empty container is an object too
        if left < 0:
            raise TooManyItems(f"more than {budget} arrays, maps and entries in them")
        return container

    return count


def safe_unpack(data: bytes, *, max_size: int, max_depth: int, max_items: int | None = None) -> tuple[Verdict, object | None]:
    """Decode untrusted msgpack under limits; returns (verdict, obj), obj is None when rejected.

    `max_depth` counts containers: a scalar is depth 0, `[1]` depth 1, `{"a": [1]}` depth 2.
    `max_items` bounds the entries of all arrays and maps together, counted while decoding
    (`counting_hook`). Pass what the message's schema can hold.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        return Verdict.reject(Reason.BAD_TYPE, f"expected bytes, got {type(data).__name__}"), None
    n = len(data) if not isinstance(data, memoryview) else data.nbytes
    if n > max_size:
        return Verdict.reject(Reason.TOO_LARGE, f"{n} bytes > limit {max_size}"), None
    if n == 0:
        return Verdict.reject(Reason.MALFORMED, "empty message"), None
    budget = n if max_items is None else min(n, max_items)
    count = None if max_items is None else counting_hook(budget)
    try:
        # Every length header is bounded by the buffer size, so a forged header that claims
        # 2**32 elements cannot make msgpack allocate before it runs out of input.
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            ext_hook=_reject_ext,
            list_hook=count,
            object_hook=count,
            max_str_len=n,
            max_bin_len=n,
            max_array_len=budget,
            max_map_len=budget,
            max_ext_len=n,
        )
    except _ExtTypeRefused as exc:
        return Verdict.reject(Reason.BAD_TYPE, str(exc)), None
    except TooManyItems as exc:
        return Verdict.reject(Reason.TOO_LARGE, str(exc)), None
    except msgpack.ExtraData as exc:
        return Verdict.reject(Reason.MALFORMED, f"trailing bytes after the message ({exc})"), None
    except msgpack.StackError:
        return Verdict.reject(Reason.TOO_DEEP, "nesting exceeds msgpack's stack"), None
    except RecursionError:
        return Verdict.reject(Reason.TOO_DEEP, "nesting exceeds the interpreter's recursion limit"), None
    except UnicodeDecodeError as exc:
        return Verdict.reject(Reason.MALFORMED, f"invalid UTF-8 in a str ({exc.reason})"), None
    except ValueError as exc:
        if budget < n and "exceeds max_" in str(exc):  # msgpack's words for a header over max_array_len / max_map_len
            return Verdict.reject(Reason.TOO_LARGE, f"{exc} (arrays, maps and entries this message may hold)"), None
        return Verdict.reject(Reason.MALFORMED, f"invalid msgpack: {type(exc).__name__}: {exc}"), None
    except Exception as exc:  # noqa: BLE001 - msgpack raises ValueError, TypeError, FormatError, ...
        return Verdict.reject(Reason.MALFORMED, f"invalid msgpack: {type(exc).__name__}: {exc}"), None
    verdict = check_tree(obj, max_depth=max_depth)
    return (verdict, obj) if verdict.ok else (verdict, None)


def check_tree(obj: object, *, max_depth: int) -> Verdict:
    """Check that `obj` holds only plain msgpack types, nests at most `max_depth`, and floats are finite."""
    # Iterative walk: a recursive one could hit the interpreter's limit on a hostile message.
    stack: list[tuple[object, int]] = [(obj, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                return Verdict.reject(Reason.NOT_FINITE, f"float {item!r} at depth {depth}")
        elif isinstance(item, (list, dict)):
            if depth + 1 > max_depth:
                return Verdict.reject(Reason.TOO_DEEP, f"nesting deeper than {max_depth}")
            if isinstance(item, dict):
                for key, value in item.items():
                    if not isinstance(key, (str, bytes)):
                        return Verdict.reject(Reason.BAD_TYPE, f"map key of type {type(key).__name__}")
                    stack.append((value, depth + 1))
            else:
                stack.extend((value, depth + 1) for value in item)
        elif not isinstance(item, _SCALARS):
            # msgpack decodes ext type -1 to a Timestamp without calling ext_hook.
            return Verdict.reject(Reason.BAD_TYPE, f"value of type {type(item).__name__} is not allowed")
    return Verdict.accept()


class Reject(Exception):
    """Carries a rejecting verdict out of nested validation; decoders catch it, it never escapes them."""

    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(detail)
        self.verdict = Verdict.reject(reason, detail)


def check_keys(obj: object, expected: frozenset[str], what: str) -> dict:
    """``obj`` as a map with exactly the ``expected`` keys, else ``Reject`` naming missing and extra keys."""
    if not isinstance(obj, dict):
        raise Reject(Reason.BAD_TYPE, f"{what} must be a map, got {type(obj).__name__}")
    if obj.keys() != expected:
        keys = set(obj)
        missing, extra = sorted(map(str, expected - keys)), sorted(map(str, keys - expected))
        raise Reject(Reason.BAD_KEYS, f"{what} keys: missing {missing}, unexpected {extra}")
    return obj
