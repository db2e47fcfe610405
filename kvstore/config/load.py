"""Loading the node config: TOML text or a parsed table -> a validated, frozen :class:`Config`.

Each value's type is checked here, against the default of its field in
:mod:`kvstore.config.node` (sizes take units, ``"64MiB"``; numbers must be finite; strings
must not hold NUL); then :func:`kvstore.config.rules.validate` checks the rules. Unknown
keys and bad values raise :class:`kvstore.common.errors.ConfigError` naming the key, e.g.
``tiers.host.capcity: unknown key``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
from typing import Any, Mapping

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from kvstore.common.errors import ConfigError
from kvstore.common.units import parse_size
from kvstore.config.node import MAX_SIZE, SIZE_KEYS, TIER_SECTIONS, Config, TierPolicyConfig
from kvstore.config.rules import validate


def _size(key: str, value: Any) -> int:
    try:
        size = parse_size(value, name=key)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    except OverflowError:   # hundreds of digits: parse_size's float becomes infinite
        raise ConfigError(f"{key}: size {value!r} is too large") from None
    if size > MAX_SIZE:
        raise ConfigError(f"{key}: size {value!r} is too large (at most {MAX_SIZE} bytes)")
    return size


def _table(key: str, value: Any, what: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected {what}, got {value!r}")
    return dict(value)


def _convert(path: str, name: str, value: Any, default: Any, ftype: Any) -> Any:
    key = f"{path}.{name}" if path else name
    if name in SIZE_KEYS:
        return _size(key, value)
    if isinstance(default, bool) or ftype in ("bool", bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return float(value)
    if isinstance(default, str):
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        if "\x00" in value:       # paths and addresses: the OS would raise ValueError at start
            raise ConfigError(f"{key}: must not contain a NUL character")
        return value
    if isinstance(default, tuple):           # a list of strings (endpoints)
        if not isinstance(value, list) or not all(isinstance(v, str) and "\x00" not in v for v in value):
            raise ConfigError(f"{key}: expected a list of strings, got {value!r}")
        return tuple(value)
    if name == "params":
        return _table(key, value, "a table")
    if name == "tenants":
        tenants = _table(key, value, "a table of tenant = \"token\" entries")
        for tenant, token in tenants.items():
            if not isinstance(token, str):
                raise ConfigError(f"{key}.{tenant}: expected a token string, got {token!r}")
        return tenants
    if name == "hop_bandwidth":      # "SRC:DST" = bytes per second (a size)
        hops = _table(key, value, "a table of \"SRC:DST\" = bytes per second entries")
        return {hop: _size(f"{key}.{hop}", rate) for hop, rate in hops.items()}
    raise ConfigError(f"{key}: unsupported value {value!r}")


def _build(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a table, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        key = f"{path}.{name}" if path else name
        if name not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(f"{key}: unknown key (known keys here: {known})")
        f = fields[name]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            kwargs[name] = _build(type(default), value, key)
        elif name == "policy" and cls in TIER_SECTIONS:
            kwargs[name] = _build(TierPolicyConfig, value, key)
        else:
            kwargs[name] = _convert(path, name, value, default, f.type)
    return cls(**kwargs)


def from_dict(data: Mapping[str, Any]) -> Config:
    """Build and validate a Config from a parsed TOML table. Raises ConfigError."""
    cfg = _build(Config, dict(data), "")
    server = data.get("server")
    if not (isinstance(server, dict) and "max_chunk_bytes" in server):
        # not given: 1 MiB, or what fits below a smaller max_message_bytes
        chunk = max(1, min(cfg.server.max_chunk_bytes, cfg.server.max_message_bytes - (16 << 10)))
        cfg = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, max_chunk_bytes=chunk))
    return validate(cfg)


def loads(text: str) -> Config:
    """Parse TOML text into a validated Config. Raises ConfigError."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config is not valid TOML: {e}") from None
    return from_dict(data)


def load(path: str | os.PathLike[str] | None) -> Config:
    """Load the config file at ``path``; ``None`` gives the built-in default.

    Raises ConfigError when the file is unreadable, not TOML, or invalid.
    """
    if path is None:
        return validate(Config())
    p = pathlib.Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read config file {str(p)!r}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not UTF-8 text (byte {e.start})") from None
    return loads(text)


def replace(cfg: Config, **sections: Any) -> Config:
    """A copy of ``cfg`` with whole sections replaced, validated again. Raises ConfigError."""
    return validate(dataclasses.replace(cfg, **sections))


__all__ = ["from_dict", "load", "loads", "replace"]
