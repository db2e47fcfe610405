"""Where a daemon's data lives and how big each tier may grow: lines for ``kvstore serve``.

:func:`data_lines` reads only the config (and, for the NVMe tier, the free space of the
filesystem it lands on), so an operator sees at start which folder fills up and by how
much, before the first put. With no config file the NVMe tier and the socket are relative
paths: they land under the folder ``kvstore serve`` runs in, which is fine for a demo and
surprising for a service, so the summary says so and shows the config that moves them.
"""

from __future__ import annotations

import os
import pathlib
import shutil

from kvstore.common.units import format_size
from kvstore.config.node import Config

UNIX_PREFIX = "unix:"

SERVICE_CONFIG_HINT = ('  for a service, give a config file (kvstore serve --config node.toml) with absolute paths: '
                       '[tiers.nvme] path = "/var/lib/kvstore/nvme" and capacity = "500GiB", '
                       '[server] listen = "unix:/run/kvstore/kvstore.sock"')


def _free_bytes(path: pathlib.Path) -> int | None:
    """Free bytes on the filesystem that holds ``path`` (its nearest existing parent)."""
    for p in (path, *path.parents):
        if p.exists():
            try:
                return shutil.disk_usage(p).free
            except OSError:
                return None
    return None


def data_lines(cfg: Config, config_path: str | os.PathLike[str] | None, cwd: pathlib.Path | None = None) -> list[str]:
    """The start-up lines that say where the data lives and each tier's limit.

    Args:
        cfg: the node's validated config.
        config_path: the file it came from, or None for the built-in default.
        cwd: the folder relative paths resolve against (default: the current folder).
    Returns:
        Lines (no trailing newline) naming each enabled tier with its capacity (bytes,
        formatted) and, for NVMe, its absolute folder and the free space there now; then
        the socket's absolute path; then, when a path is relative or no config was given,
        which folder they depend on and the config keys that move them.
    """
    cwd = pathlib.Path.cwd() if cwd is None else cwd
    t = cfg.tiers
    lines = ["  data:"]
    if t.hbm.enabled:
        lines.append(f"    hbm    up to {format_size(t.hbm.capacity)} of GPU memory on cuda:{t.hbm.device}, "
                     "allocated at start")
    if t.host.enabled:
        kind = "shared memory (memfd)" if t.host.shared else "host memory"
        lines.append(f"    host   up to {format_size(t.host.capacity)} of {kind}, allocated at start "
                     "(copied to NVMe on a graceful stop)")
    relative = []
    if t.nvme.enabled:
        nvme = pathlib.Path(t.nvme.path)
        if not nvme.is_absolute():
            relative.append(f"[tiers.nvme] path = {t.nvme.path!r}")
        where = (cwd / nvme).resolve()
        free = _free_bytes(where)
        room = "" if free is None else f" ({format_size(free)} free there now" + (
            "; the capacity is more than that" if free < t.nvme.capacity else "") + ")"
        lines.append(f"    nvme   up to {format_size(t.nvme.capacity)} of files in {where}{room}; kept across restarts")
    if t.remote.enabled:
        lines.append(f"    remote up to {format_size(t.remote.capacity)} in the Mooncake Store cluster of master "
                     f"{t.remote.master}")
    listen = cfg.server.listen
    if listen.startswith(UNIX_PREFIX):
        sock = pathlib.Path(listen[len(UNIX_PREFIX):])
        if not sock.is_absolute():
            relative.append(f"[server] listen = {listen!r}")
        lines.append(f"    socket {(cwd / sock).resolve()}")
    if config_path is None:
        lines += [f"  no --config: built-in defaults, so the data lives under the current folder ({cwd})",
                  SERVICE_CONFIG_HINT]
    elif relative:
        lines += [f"  relative paths ({', '.join(relative)}) resolve against the current folder ({cwd})",
                  SERVICE_CONFIG_HINT]
    return lines
