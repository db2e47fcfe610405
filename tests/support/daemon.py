"""Daemon helpers shared by the tests: where the traces are, a short socket folder, and the
config of a small in-process daemon. Import as ``from support.daemon import ...`` (a
``conftest`` module name is ambiguous: several test folders have one)."""

from __future__ import annotations

import os
import pathlib
import tempfile

from kvstore import config

ROOT = pathlib.Path(__file__).resolve().parents[2]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child Python that imports the checkout: ``ROOT`` first
    on ``PYTHONPATH``, the caller's own entries kept (packages installed by path stay found)."""
    paths = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), **extra}


SHARED_DATA = ROOT.parent / "shared" / "data"
CONVERSATION_TRACE = SHARED_DATA / "traces" / "mooncake_conversation_trace.jsonl"


def short_socket_dir() -> pathlib.Path:
    """A short folder for unix sockets (their paths are limited to ~107 bytes)."""
    return pathlib.Path(tempfile.mkdtemp(prefix="kvs-"))


def daemon_config(tmp_path: pathlib.Path, *, host: str | int = "64MiB", nvme: str | int | None = "256MiB",
                  extra: dict | None = None) -> config.Config:
    """A daemon on a fresh unix socket with a host tier and (unless ``nvme`` is None) an
    NVMe tier under ``tmp_path``; ``extra`` updates whole config sections."""
    data: dict = {
        "server": {"listen": f"unix:{short_socket_dir()}/kvstore.sock", "workers": 4},
        "tiers": {
            "host": {"capacity": host},
            "nvme": {"enabled": nvme is not None, "path": str(tmp_path / "nvme"),
                     "capacity": nvme if nvme is not None else "1MiB"},
        },
    }
    for section, values in (extra or {}).items():
        data.setdefault(section, {}).update(values)
    return config.from_dict(data)
