"""Security: tenant isolation, bearer tokens on every call (constant-time checks), TLS,
the unix socket's permissions, and hostile key bytes that must never become paths."""

from __future__ import annotations

import hashlib
import hmac
import os
import pathlib
import shutil
import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from support.daemon import daemon_config
from kvstore.service import auth
from kvstore import config
from kvstore.common import errors
from kvstore.service.auth import Authenticator, tenant_key
from kvstore.client.client import KVStoreClient
from kvstore.common.errors import ConfigError
from kvstore.service.startup import start_server
from rel_support import key, payload
from tiers.base import TierKind

TENANTS = {"alice": "token-of-alice-3f9a", "bob": "token-of-bob-77c1", "carol": "token-of-carol-0d2e"}
METHODS = {   # every RPC of the service and its (request streaming, response streaming) kind
    "Put": (True, False), "PutInline": (False, False), "Get": (False, True), "Lookup": (False, False),
    "Delete": (False, False), "Stats": (False, False), "ToolCallStart": (False, False),
    "Resume": (False, False), "Lease": (False, False), "Release": (False, False),
}


def tenant_daemon(tmp_path, listen=None, **server):
    s = {"tenants": TENANTS, **server}
    if listen:
        s["listen"] = listen
    return start_server(daemon_config(tmp_path, host="4MiB", nvme="64MiB",
                                      extra={"server": s, "prefetch": {"enabled": True}}))


@pytest.fixture
def tenants(tmp_path):
    d = tenant_daemon(tmp_path)
    clients = {name: KVStoreClient(d.address, auth_token=tok, timeout=10) for name, tok in TENANTS.items()}
    yield d, clients
    for c in clients.values():
        c.close()
    d.stop(0)


# ------------------------------------------------------------------------ tenants


def test_tenants_never_see_each_others_blocks(tenants, tmp_path):
    d, c = tenants
    a, b = c["alice"], c["bob"]
    shared = [key(i, "same-prompt") for i in range(4)]        # identical keys in both tenants
    big = key(99, "big")
    a.put([(k, payload(k, 5000, variant=1)) for k in shared] + [(big, payload(big, 3 << 20, variant=1))])

    assert b.lookup(shared).hit_blocks == 0
    assert [g.found for g in b.get(shared + [big])] == [False] * 5
    assert b.delete(shared + [big]) == 0
    assert a.lookup(shared).hit_blocks == 4                     # bob's delete did nothing

    stored = b.put([(k, payload(k, 7000, variant=2)) for k in shared])
    assert (stored.stored, stored.already_present) == (4, 0)    # not "already present": another space
    for who, variant, n in ((a, 1, 5000), (b, 2, 7000)):
        got = who.get(shared)
        assert [g.key for g in got] == shared                    # replies carry the client's keys
        assert all(g.data == payload(g.key, n, variant=variant) for g in got)
    got = a.get([big])[0]                                        # a chunked reply: same rule
    assert got.key == big and got.data == payload(big, 3 << 20, variant=1)

    assert a.delete(shared) == 4
    assert b.lookup(shared).hit_blocks == 4 and a.lookup(shared).hit_blocks == 0
    assert c["carol"].lookup(shared).hit_blocks == 0

    # what the store holds are internal keys only
    m = d.manager
    assert all(k not in m for k in shared + [big])
    assert all(tenant_key("bob", k) in m for k in shared) and tenant_key("alice", big) in m
    for k in shared:
        assert tenant_key("alice", k) != tenant_key("bob", k)


def test_tenant_keys_reach_the_disk_only_as_their_hashes(tmp_path):
    d = tenant_daemon(tmp_path)
    k = key(1, "disk")
    try:
        with KVStoreClient(d.address, auth_token=TENANTS["alice"]) as a:
            a.put([(k, payload(k, 9000))])
            assert d.manager.demote(tenant_key("alice", k), 0)
            assert d.manager.tier_of(tenant_key("alice", k)) == TierKind.NVME
            assert a.get([k])[0].data == payload(k, 9000)
    finally:
        d.stop(0)
    names = [p.name for p in (tmp_path / "nvme").rglob("*")]
    assert tenant_key("alice", k).hex() in names
    assert not any(k.hex() in n for n in names)


def test_trajectory_hints_are_private_to_a_tenant(tenants):
    _, c = tenants
    k = key(5, "traj")
    c["alice"].put([(k, b"x" * 100)])
    c["alice"].tool_call_start("trajectory-1", "search", [k])
    assert c["bob"].resume("trajectory-1")[0] is False           # bob cannot close alice's call
    assert c["alice"].resume("trajectory-1")[0] is True


def test_tenant_key_is_domain_separated_and_length_prefixed():
    k = bytes(range(32))
    assert tenant_key("ab", k) != tenant_key("a", b"b" + k[:31])
    assert tenant_key("a", k) == hashlib.sha256(auth.TENANT_KEY_DOMAIN + b"\0\0\0\x01a" + k).digest()
    assert len({tenant_key(t, k) for t in ("a", "b", "A", "a ", "")}) == 5


# ------------------------------------------------------------------------ tokens


def raw_call(address, method, metadata, credentials=None):
    """Call ``method`` with an empty request and ``metadata``; returns the status code."""
    ch = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with ch:
        path = f"/kvstore.v1.KVStore/{method}"
        stream_in, stream_out = METHODS[method]
        kind = {(False, False): ch.unary_unary, (True, False): ch.stream_unary,
                (False, True): ch.unary_stream, (True, True): ch.stream_stream}[(stream_in, stream_out)]
        call = kind(path, request_serializer=None, response_deserializer=None)
        request = iter([b""]) if stream_in else b""
        try:
            reply = call(request, timeout=10, metadata=metadata)
            if stream_out:
                list(reply)
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()


BAD_AUTH = {
    "none": [],
    "wrong": [("authorization", "Bearer wrong-token")],
    "prefix": [("authorization", "Bearer " + TENANTS["alice"][:-1])],
    "suffix": [("authorization", "Bearer " + TENANTS["alice"] + "x")],
    "trailing space": [("authorization", "Bearer " + TENANTS["alice"] + " ")],
    "no scheme": [("authorization", TENANTS["alice"])],
    "lower-case scheme": [("authorization", "bearer " + TENANTS["alice"])],
    "empty bearer": [("authorization", "Bearer ")],
    "two headers, one right": [("authorization", "Bearer wrong"), ("authorization", "Bearer " + TENANTS["alice"])],
    "two right headers": [("authorization", "Bearer " + TENANTS["alice"])] * 2,
    "other header": [("x-authorization", "Bearer " + TENANTS["alice"])],
}


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_every_method_refuses_a_missing_or_wrong_token(tmp_path, transport):
    d = tenant_daemon(tmp_path, listen="127.0.0.1:0" if transport == "tcp" else None)
    try:
        for method in METHODS:
            for case, metadata in BAD_AUTH.items():
                assert raw_call(d.address, method, metadata) == grpc.StatusCode.UNAUTHENTICATED, (method, case)
            good = raw_call(d.address, method, [("authorization", "Bearer " + TENANTS["bob"])])
            assert good != grpc.StatusCode.UNAUTHENTICATED, method
        # health stays open for probes, and reveals nothing else
        with grpc.insecure_channel(d.address) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert len(d.manager) == 0, "a refused call changed the store"
    finally:
        d.stop(0)


def test_single_auth_token_guards_every_method(tmp_path):
    d = start_server(daemon_config(tmp_path, extra={"server": {"auth_token": "only-token-8c21-4d"}}))
    try:
        for method in METHODS:
            assert raw_call(d.address, method, []) == grpc.StatusCode.UNAUTHENTICATED, method
            assert raw_call(d.address, method, [("authorization", "Bearer only-token-8c21-4")]) == \
                grpc.StatusCode.UNAUTHENTICATED, method
        with KVStoreClient(d.address, auth_token="only-token-8c21-4d") as c:
            k = key(1, "single")
            assert c.put([(k, b"v" * 10)]).stored == 1
        assert k in d.manager                                    # one shared space: keys as sent
    finally:
        d.stop(0)


def test_token_check_compares_every_token_over_fixed_length_digests(monkeypatch):
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    a = Authenticator({tok: name for name, tok in TENANTS.items()})
    for presented, expected in ((TENANTS["alice"], "alice"), (TENANTS["carol"], "carol"), ("x", None),
                                ("y" * 4000, None), (TENANTS["bob"][:5], None)):
        calls.clear()
        assert a.tenant_for([("authorization", "Bearer " + presented)]) == expected
        # no early exit on a match or a length difference: every token, 32-byte inputs
        assert calls == [(32, 32)] * len(TENANTS)


@pytest.mark.parametrize("server,needle", [
    ({"tenants": {"a": "token-of-tenant-a"}, "auth_token": "token-of-everyone"}, "cannot be combined"),
    ({"tenants": {"a": "the-same-token-0001", "b": "the-same-token-0001"}}, "same token"),
    ({"tenants": {"a": "short-token"}}, r"server.tenants.a: the token has 11 characters; at least 16"),
    ({"auth_token": "short-token"}, r"server.auth_token: the token has 11 characters; at least 16"),
    ({"tenants": {"a": ""}}, "server.tenants.a"),
    ({"tenants": {"a": "has space"}}, "server.tenants.a"),
    ({"tenants": {"a": "nön-ascii"}}, "server.tenants.a"),
    ({"tenants": {"": "tok"}}, "tenant name"),
    ({"tenants": {"a\x00b": "tok"}}, "tenant name"),
    ({"tenants": {"a": 5}}, "server.tenants.a"),
    ({"tenants": "tok"}, "server.tenants"),
    ({"auth_token": "two words"}, "server.auth_token"),
    ({"listen": "0.0.0.0:50051"}, "server.listen"),
    ({"listen": "10.1.2.3:50051"}, "server.listen"),
])
def test_access_config_errors(server, needle):
    with pytest.raises(ConfigError, match=needle):
        config.from_dict({"server": server})


@pytest.mark.parametrize("listen", ["127.0.0.1:0", "localhost:50051", "[::1]:50051", "unix:/tmp/x.sock"])
def test_loopback_and_unix_listen_need_no_token(listen):
    assert config.from_dict({"server": {"listen": listen}}).server.listen == listen


def test_network_listen_with_a_token_or_tenants_is_accepted():
    token = "t0k-of-16-chars!"
    assert config.from_dict({"server": {"listen": "0.0.0.0:1", "auth_token": token}}).server.auth_token
    assert config.from_dict({"server": {"listen": "0.0.0.0:1", "tenants": {"a": token}}}).server.tenants == {"a": token}


# ------------------------------------------------------------------------ TLS


def self_signed_cert(folder: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """A self-signed certificate for localhost / 127.0.0.1 (the ``cryptography`` package,
    else the ``openssl`` command); skips when neither is available."""
    cert, key_file = folder / "cert.pem", folder / "key.pem"
    try:
        import datetime

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor the openssl command can make a certificate")
        done = subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                               "-nodes", "-keyout", str(key_file), "-out", str(cert), "-days", "1",
                               "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"openssl cannot make a certificate: {done.stderr.strip()[:200]}")
        return cert, key_file
    import ipaddress
    pk = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    crt = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(pk.public_key())
           .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
           .not_valid_after(now + datetime.timedelta(days=1))
           .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                       x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                          critical=False)
           .sign(pk, hashes.SHA256()))
    cert.write_bytes(crt.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(pk.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return cert, key_file


def test_tls_with_tokens(tmp_path):
    cert, key_file = self_signed_cert(tmp_path)
    other_cert, _ = self_signed_cert(tmp_path / "other") if (tmp_path / "other").mkdir() is None else (None, None)
    d = tenant_daemon(tmp_path, listen="127.0.0.1:0", tls_cert=str(cert), tls_key=str(key_file))
    try:
        root = cert.read_bytes()
        k = key(1, "tls")
        with KVStoreClient(d.address, auth_token=TENANTS["alice"], root_certificates=root, timeout=10) as c:
            assert c.put([(k, payload(k, 100_000))]).stored == 1
            assert c.get([k])[0].data == payload(k, 100_000)
        with KVStoreClient(d.address, auth_token="wrong", root_certificates=root, timeout=10) as c:
            with pytest.raises(errors.Unauthenticated):
                c.lookup([k])
        with KVStoreClient(d.address, auth_token=TENANTS["alice"], timeout=3) as c:   # plaintext
            with pytest.raises(errors.StoreUnavailable):
                c.lookup([k])
        with KVStoreClient(d.address, auth_token=TENANTS["alice"], root_certificates=other_cert.read_bytes(),
                           timeout=3) as c:                                          # untrusted server
            with pytest.raises(errors.StoreUnavailable):
                c.lookup([k])
        creds = grpc.ssl_channel_credentials(root_certificates=root)
        assert raw_call(d.address, "Stats", [], credentials=creds) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        d.stop(0)


# ------------------------------------------------------------------------ unix socket


def test_unix_socket_is_0600_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        d = start_server(daemon_config(tmp_path))
    finally:
        os.umask(old)
    try:
        sock = pathlib.Path(d.address[len("unix:"):])
        assert sock.stat().st_mode & 0o777 == 0o600
    finally:
        d.stop(0)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to try the socket as another user")
def test_another_user_cannot_connect_to_the_unix_socket(tmp_path):
    d = start_server(daemon_config(tmp_path))
    try:
        sock = pathlib.Path(d.address[len("unix:"):])
        os.chmod(sock.parent, 0o755)                 # the folder is open: only the socket's mode protects
        probe = ("import socket, sys\n"
                 "s = socket.socket(socket.AF_UNIX)\n"
                 "try:\n    s.connect(sys.argv[1])\nexcept PermissionError:\n    sys.exit(13)\n"
                 "sys.exit(0)\n")
        python = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3")
                       if os.path.exists(p) and os.stat(p).st_mode & 0o001), None)
        if python is None:
            pytest.skip("no Python interpreter that another user may run")
        done = subprocess.run([python, "-c", probe, str(sock)], user=65534, group=65534, cwd="/",
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 13, (done.returncode, done.stderr)
        assert sock.stat().st_mode & 0o777 == 0o600
    finally:
        d.stop(0)


# ------------------------------------------------------------------------ hostile keys


HOSTILE_KEYS = [
    b"../" * 10 + b"..",
    b"/etc/passwd".ljust(32, b"\0"),
    b"..\\..\\..\\windows\\system32\\x".ljust(32, b"."),
    b"%2e%2e%2f%2e%2e%2fetc%2fpasswd".ljust(32, b"%"),
    b"\0" * 32,
    b"." * 32,
    b"/" * 32,
    b"\n\r\t " * 8,
    b"\xff" * 32,
    b"blocks/../../LOCK".ljust(32, b"/"),
]


@pytest.mark.parametrize("with_tenants", [False, True])
def test_hostile_key_bytes_never_become_paths(tmp_path, with_tenants):
    extra = {"tiers": {"host": {"enabled": False}}}
    if with_tenants:
        extra["server"] = {"tenants": TENANTS}
    before = {p for p in tmp_path.rglob("*")}
    d = start_server(daemon_config(tmp_path, nvme="64MiB", extra=extra))
    token = TENANTS["alice"] if with_tenants else ""
    try:
        with KVStoreClient(d.address, auth_token=token) as c:
            blocks = [(k, payload(hashlib.sha256(k).digest(), 5000)) for k in HOSTILE_KEYS]
            assert c.put(blocks).stored == len(blocks)
            got = c.get([k for k, _ in blocks])
            assert [g.data for g in got] == [v for _, v in blocks]
            assert c.delete([k for k, _ in blocks[:3]]) == 3
    finally:
        d.stop(0)
    nvme = tmp_path / "nvme"
    created = {p for p in tmp_path.rglob("*")} - before
    outside = [p for p in created if p != nvme and nvme not in p.parents]
    assert outside == [], f"files created outside the tier folder: {outside}"
    names = {p.name for p in (nvme / "blocks").rglob("*") if p.is_file()}
    expected = {(tenant_key("alice", k) if with_tenants else k).hex() for k in HOSTILE_KEYS[3:]}
    assert names == expected
    for p in (nvme / "blocks").rglob("*"):
        assert not p.is_symlink()
        rel = p.relative_to(nvme / "blocks").parts
        assert all(len(part) in (3, 64) and set(part) <= set("0123456789abcdef") for part in rel), rel
