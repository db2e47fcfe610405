"""A one-machine Mooncake cluster on loopback: a master and storage-only peers.

For tests, benchmarks and trying the remote tier on one machine; a real deployment
runs ``mooncake_master`` as a service (``scripts/setup-mooncake.sh`` prints how).

From a shell::

    python -m tiers.mooncake.local_cluster master [--rpc-port 50051 --http-port 8080]
    python -m tiers.mooncake.local_cluster segment --master 127.0.0.1:50051 \\
        --metadata http://127.0.0.1:8080/metadata --segment-mib 1024
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_LEASE_TTL_MS = 5000
"""Object lease the master grants on a read: seconds, not Mooncake's test value of
100 ms, at which large batch gets fail with LEASE_EXPIRED."""


def master_binary() -> str:
    """Path of the ``mooncake_master`` binary shipped in the Mooncake wheel.
    Raises FileNotFoundError when the wheel is not installed."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the Mooncake wheel is not installed (mooncake-transfer-engine-non-cuda)")
    path = Path(list(spec.submodule_search_locations)[0]) / "mooncake_master"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the Mooncake wheel")
    return str(path)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _temp_log(prefix: str) -> str:
    with tempfile.NamedTemporaryFile(prefix=prefix, suffix=".log", delete=False) as f:
        return f.name


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class LocalMaster:
    """A ``mooncake_master`` child process on 127.0.0.1 with its HTTP metadata server.

    Args:
        lease_ttl_ms: object lease in milliseconds (``-default_kv_lease_ttl``).
        client_ttl_s: seconds without heartbeat after which the master drops a client
            and its segment (``-client_ttl``; Mooncake's default is 10).
        log_path: file for the master's output (default: a temporary file).

    Attributes:
        address: ``127.0.0.1:<rpc port>``, the ``master`` setting of the remote tier.
        metadata_server: ``http://127.0.0.1:<port>/metadata``.
    """

    def __init__(self, *, lease_ttl_ms: int = DEFAULT_LEASE_TTL_MS, client_ttl_s: int = 10,
                 log_path: str | None = None):
        self.lease_ttl_ms = lease_ttl_ms
        self.client_ttl_s = client_ttl_s
        self.log_path = log_path or _temp_log("mooncake-master-")
        self.rpc_port = free_port()
        self.http_port = free_port()
        self.metrics_port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def command(self) -> list[str]:
        return [master_binary(), "-rpc_address", "127.0.0.1", f"-rpc_port={self.rpc_port}",
                "-enable_http_metadata_server=true", "-http_metadata_server_host", "127.0.0.1",
                f"-http_metadata_server_port={self.http_port}", "-metrics_host", "127.0.0.1",
                f"-metrics_port={self.metrics_port}", f"-default_kv_lease_ttl={self.lease_ttl_ms}",
                f"-client_ttl={self.client_ttl_s}", "-rpc_thread_num=2"]

    def start(self, timeout_s: float = 30.0) -> "LocalMaster":
        """Start (or restart, on the same ports) and wait until both ports answer.
        Raises RuntimeError with the log's tail when it does not come up."""
        if self.running:
            return self
        deadline = time.monotonic() + timeout_s
        while _port_open(self.rpc_port) and time.monotonic() < deadline:     # a killed master's port
            time.sleep(0.1)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if _port_open(self.rpc_port) and _port_open(self.http_port):
                return self
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"mooncake_master did not come up on {self.address}; log {self.log_path}:\n"
                           + self.log_tail())

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the master (its objects are lost) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        """SIGSTOP: the master keeps its connections but answers nothing (a stall)."""
        if self.running:
            os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.running:
            os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s."""
        if self.running:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, nbytes: int = 4000) -> str:
        try:
            return Path(self.log_path).read_bytes()[-nbytes:].decode(errors="replace")
        except OSError:
            return ""

    def __enter__(self) -> "LocalMaster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LocalSegment:
    """A storage-only cluster node in a child process: it mounts ``segment_bytes`` of
    memory into the pool and serves transfers until killed (a peer to kill in tests)."""

    def __init__(self, master: LocalMaster, segment_bytes: int, log_path: str | None = None):
        self.master = master
        self.segment_bytes = segment_bytes
        self.log_path = log_path or _temp_log("mooncake-segment-")
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60.0) -> "LocalSegment":
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tiers.mooncake.local_cluster", "segment", "--master", self.master.address,
             "--metadata", self.master.metadata_server, "--segment-bytes", str(self.segment_bytes)],
            stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, text=True,
            cwd=str(Path(__file__).resolve().parent.parent))
        log.close()
        line = _readline(self.proc, timeout_s)
        if line.strip() != "ready":
            self.kill()
            raise RuntimeError(f"segment node did not start ({line.strip()!r}); log {self.log_path}")
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)


def _readline(proc: subprocess.Popen, timeout_s: float) -> str:
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            return ""
    return proc.stdout.readline()


def _serve_segment(master: str, metadata: str, segment_bytes: int) -> int:
    from tiers.mooncake.client import store_class

    store = store_class()()
    rc = store.setup({"local_hostname": "127.0.0.1", "metadata_server": metadata, "global_segment_size": segment_bytes,
                      "local_buffer_size": 1 << 20, "protocol": "tcp", "master_server_addr": master})
    if rc != 0:
        print(f"setup failed: {rc}", flush=True)
        return 1
    print("ready", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    store.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tiers.mooncake.local_cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("master", help="run a master on loopback until interrupted")
    m.add_argument("--lease-ttl-ms", type=int, default=DEFAULT_LEASE_TTL_MS)
    s = sub.add_parser("segment", help="run a storage-only node until SIGTERM")
    s.add_argument("--master", required=True)
    s.add_argument("--metadata", required=True)
    s.add_argument("--segment-bytes", type=int, default=1 << 30)
    args = parser.parse_args(argv)
    if args.cmd == "segment":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        return _serve_segment(args.master, args.metadata, args.segment_bytes)
    master = LocalMaster(lease_ttl_ms=args.lease_ttl_ms).start()
    print(f"master = \"{master.address}\"\nmetadata_server = \"{master.metadata_server}\"\nlog: {master.log_path}",
          flush=True)
    try:
        master.proc.wait()
    except KeyboardInterrupt:
        master.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
