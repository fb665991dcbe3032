"""Plain structured data in the control plane's ``*_json`` bytes fields.

A resize's or a restore's description and the peer-snapshot records are nested plain data
(dicts, lists, numbers, strings) that would take a large message tree to spell out in proto;
they travel as JSON instead. JSON objects have string keys only, and these documents key
dicts by integers too (ranks, parameter indices), so a dict with any non-string key is written
as ``{"__pairs__": [[key, value], ...]}`` and read back with its keys as they were. Tuples come
back as lists. Anything else (tensors, arbitrary objects) is refused: it does not belong on the
control plane.
"""

from __future__ import annotations

import json
import math
from typing import Any

from zero_ray.errors import ConfigError

_PAIRS = "__pairs__"
_KEY_TYPES = (str, int, float, bool, type(None))


def _encode(value: Any, where: str) -> Any:
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and list(value) != [_PAIRS]:
            return {k: _encode(v, f"{where}.{k}") for k, v in value.items()}
        bad = [k for k in value if not isinstance(k, _KEY_TYPES)]
        if bad:
            raise ConfigError(f"{where} has keys of type {type(bad[0]).__name__}; plain data keys are str or numbers")
        return {_PAIRS: [[k, _encode(v, f"{where}[{k!r}]")] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return [_encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, float) and not math.isfinite(value):
        return value  # Python's json writes NaN and Infinity and reads them back
    if isinstance(value, _KEY_TYPES):
        return value
    raise ConfigError(f"{where} is a {type(value).__name__}; only plain data (dict, list, number, str, None) "
                      "travels in the control plane's JSON fields")


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if list(value) == [_PAIRS]:
            return {k: _decode(v) for k, v in value[_PAIRS]}
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def dumps(value: Any) -> bytes:
    """``value`` as UTF-8 JSON, integer-keyed dicts included; ConfigError for what is not plain data."""
    return json.dumps(_encode(value, "value"), separators=(",", ":")).encode()


def loads(data: bytes) -> Any:
    """What :func:`dumps` wrote; ConfigError for bytes that are not such a document."""
    try:
        return _decode(json.loads(data))
    except (ValueError, TypeError, KeyError) as err:
        raise ConfigError(f"not a plain-data JSON document ({len(data)} bytes): {err}") from err
