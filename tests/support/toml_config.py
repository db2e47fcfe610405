"""Daemon configs written by tests: nested dicts as TOML tables."""

from __future__ import annotations

import pathlib


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    raise TypeError(f"cannot write {v!r} as TOML")


def write_toml(path: pathlib.Path, data: dict) -> pathlib.Path:
    """Write nested dicts of str / int / float / bool as TOML tables (enough for daemon
    configs); returns ``path``. Raises TypeError for any other value."""
    lines: list[str] = []

    def table(prefix: str, d: dict) -> None:
        if prefix:
            lines.append(f"[{prefix}]")
        lines.extend(f'"{k}" = {_toml_value(v)}' for k, v in d.items() if not isinstance(v, dict))
        for k, v in d.items():
            if isinstance(v, dict):
                table(f"{prefix}.{k}" if prefix else k, v)

    table("", data)
    path.write_text("\n".join(lines) + "\n")
    return path
