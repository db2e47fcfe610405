"""One address, one daemon, whatever the spelling (issue 19, item 17).

gRPC binds every address a host name stands for and starts when one of them binds:
a daemon on ``localhost:P`` started beside one on ``127.0.0.1:P`` (binding only ``[::1]:P``),
and clients were split by how they spelt the address. And a daemon replaced the live
unix socket of another program. Both are refused now, and the other program keeps its
socket.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import threading

import pytest

from kvstore import config
from kvstore.client.client import KVStoreClient
from kvstore.common.errors import ConfigError
from kvstore.service.listen import addresses_of
from kvstore.service.startup import start_server
from support.daemon import daemon_config, short_socket_dir


def has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def on(tmp_path, name: str, listen: str, **extra) -> config.Config:
    cfg = daemon_config(tmp_path / name, host="4MiB", nvme=None, extra=extra)
    return config.replace(cfg, server=dataclasses.replace(cfg.server, listen=listen))


SPELLINGS = [("127.0.0.1", "localhost"), ("localhost", "127.0.0.1"), ("[::1]", "localhost"), ("localhost", "[::1]")]


@pytest.mark.parametrize("first,second", SPELLINGS, ids=[f"{a}-then-{b}" for a, b in SPELLINGS])
def test_a_second_daemon_on_the_same_port_spelt_another_way_is_refused(tmp_path, first, second):
    if "[::1]" in (first, second) and not has_ipv6_loopback():
        pytest.skip("this machine has no IPv6 loopback address")
    if first == "localhost":            # a port free on both loopback addresses
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    else:
        port = 0
    a = start_server(on(tmp_path, "a", f"{first}:{port}"))
    try:
        port = int(a.address.rsplit(":", 1)[1])
        with pytest.raises(ConfigError, match=re.escape(f"server.listen: cannot bind {second}:{port}: the port is in use")):
            b = start_server(on(tmp_path, "b", f"{second}:{port}"))
            b.stop(0)
        with KVStoreClient(f"{first}:{port}", timeout=20) as c:       # the first one still serves alone
            assert c.put([(b"k" * 32, b"one")]).stored == 1
            assert c.get([b"k" * 32])[0].data == b"one"
    finally:
        a.stop(0)


def test_localhost_stands_for_both_loopback_addresses():
    got = {(fam, addr[0]) for fam, addr in addresses_of("localhost", 5)}
    assert (socket.AF_INET, "127.0.0.1") in got and (socket.AF_INET6, "::1") in got
    assert [a for _, a in addresses_of("[::1]", 7)] == [("::1", 7)]


class PlainServer:
    """Another program: a plain Python unix socket server that answers ``pong``."""

    def __init__(self, path: str):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(8)
        self.inode = os.stat(path).st_ino
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.sendall(b"pong")
                except OSError:
                    pass

    def answers(self) -> bool:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(self.path)
            return s.recv(4) == b"pong"

    def close(self) -> None:
        self.sock.close()


def test_a_unix_socket_another_program_serves_is_refused_and_left_intact(tmp_path):
    path = str(short_socket_dir() / "kvstore.sock")
    other = PlainServer(path)
    try:
        with pytest.raises(ConfigError, match="another process serves the socket"):
            d = start_server(on(tmp_path, "a", f"unix:{path}"))
            d.stop(0)
        assert os.stat(path).st_ino == other.inode and other.answers()
    finally:
        other.close()


def test_a_stale_unix_socket_is_replaced(tmp_path):
    path = str(short_socket_dir() / "kvstore.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:     # bound, never served: its process died
        s.bind(path)
    d = start_server(on(tmp_path, "a", f"unix:{path}"))
    try:
        with KVStoreClient(d.address, timeout=20) as c:
            assert c.put([(b"s" * 32, b"x")]).stored == 1
    finally:
        d.stop(0)


def test_an_arena_socket_another_program_serves_is_left_intact(tmp_path):
    folder = short_socket_dir()
    other = PlainServer(str(folder / "kvstore.sock.arena"))
    try:
        d = start_server(on(tmp_path, "a", f"unix:{folder / 'kvstore.sock'}"))
        try:
            with KVStoreClient(d.address, timeout=20) as c:
                info = c.info()
                assert info.shm_socket == "" and "another process serves the socket" in info.shm_refused
                assert c.put([(b"a" * 32, b"x")]).stored == 1           # gRPC still serves
        finally:
            d.stop(0)
        assert os.stat(other.path).st_ino == other.inode and other.answers()
    finally:
        other.close()


def test_an_ipc_events_endpoint_another_program_serves_is_refused(tmp_path):
    path = str(short_socket_dir() / "events.ipc")
    other = PlainServer(path)
    try:
        with pytest.raises(ConfigError, match="events.endpoint: another process serves the socket"):
            d = start_server(daemon_config(tmp_path, host="4MiB", nvme=None,
                                           extra={"events": {"enabled": True, "endpoint": f"ipc://{path}"}}))
            d.stop(0)
        assert os.stat(path).st_ino == other.inode and other.answers()
    finally:
        other.close()


@pytest.mark.parametrize("section,key", [("metrics", "listen"), ("events", "endpoint")])
def test_metrics_and_events_ports_spelt_another_way_are_refused(tmp_path, section, key):
    with socket.socket() as other:                       # another daemon's endpoint on 127.0.0.1:P
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", 0))
        other.listen(1)
        port = other.getsockname()[1]
        value = f"localhost:{port}" if section == "metrics" else f"tcp://localhost:{port}"
        extra = {"metrics": {"listen": value}} if section == "metrics" else {"events": {"enabled": True, key: value}}
        with pytest.raises(ConfigError, match=re.escape(f"{section}.{key}: cannot bind localhost:{port}: "
                                                        "the port is in use")):
            d = start_server(daemon_config(tmp_path, host="4MiB", nvme=None, extra=extra))
            d.stop(0)


@pytest.mark.parametrize("server, metrics, events, clash", [
    ("127.0.0.1:50101", "127.0.0.1:50101", None, "metrics.listen: port 50101 is server.listen's too"),
    ("localhost:50102", "127.0.0.1:50102", None, "metrics.listen: port 50102 is server.listen's too"),
    ("127.0.0.1:50103", "0.0.0.0:50103", None, "metrics.listen: port 50103 is server.listen's too"),
    ("unix:kv.sock", "127.0.0.1:50104", "tcp://*:50104", "events.endpoint: port 50104 is metrics.listen's too"),
    ("127.0.0.1:50105", "", "tcp://127.0.0.1:50105", "events.endpoint: port 50105 is server.listen's too"),
])
def test_the_config_giving_one_port_twice_is_refused_naming_both_keys(server, metrics, events, clash):
    data = {"server": {"listen": server, "auth_token": "t" * 32}, "metrics": {"listen": metrics}}
    if events:
        data["events"] = {"enabled": True, "endpoint": events}
    with pytest.raises(ConfigError, match=re.escape(clash)):
        config.from_dict(data)


def test_listen_addresses_on_other_ports_or_hosts_are_accepted():
    cfg = config.from_dict({"server": {"listen": "127.0.0.1:50106"}, "metrics": {"listen": "127.0.0.2:50106"},
                            "events": {"enabled": True, "endpoint": "tcp://127.0.0.1:50107"}})
    assert cfg.metrics.listen == "127.0.0.2:50106"
    assert config.from_dict({"server": {"listen": "127.0.0.1:0"}, "metrics": {"listen": "127.0.0.1:0"}})
