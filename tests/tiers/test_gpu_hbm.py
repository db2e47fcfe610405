"""HBM tier on a real GPU: device slab, host/device copies, CUDA IPC from another process."""

from __future__ import annotations

import hashlib
import json
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tiers.base import read_bytes
from tiers.gpu import gpu_info

info = gpu_info()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (info.available and info.cupy),
                                 reason=info.reason or "CuPy is not installed (the HBM tier needs it)")]

ROOT = pathlib.Path(__file__).resolve().parents[2]


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def payload(i: int, n: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture
def tier():
    from tiers.hbm import HBMTier
    t = HBMTier(1 << 24)
    yield t
    t.close()


def test_host_and_device_copies(tier):
    import cupy
    import torch

    assert tier.backend == "cuda" and tier.device == 0
    a = payload(1, 100_000)
    tier.reserve(key(1), len(a))
    tier.write(key(1), 0, a[:30_000])
    tier.write(key(1), 30_000, memoryview(a)[30_000:])
    tier.commit(key(1))
    assert read_bytes(tier, key(1)) == a
    assert read_bytes(tier, key(1), [(5, 10), (99_990, 10)]) == a[5:15] + a[99_990:]
    assert tier.capabilities.host is None and tier.capabilities.device is tier
    out = np.zeros(100_000, dtype=np.uint8)
    assert tier.read_into(key(1), out) == 100_000 and out.tobytes() == a
    dev = tier.device_array(key(1))
    assert isinstance(dev, cupy.ndarray) and dev.nbytes == 100_000
    assert cupy.asnumpy(dev).tobytes() == a
    assert dev.data.ptr % 4096 == 0

    b = payload(2, 8192)                                        # device-to-device from CuPy
    tier.reserve(key(2), len(b))
    tier.write(key(2), 0, cupy.asarray(np.frombuffer(b, dtype=np.uint8)))
    tier.commit(key(2))
    assert read_bytes(tier, key(2)) == b

    c = torch.arange(1000, dtype=torch.float32, device="cuda")  # and from a torch CUDA tensor
    tier.reserve(key(3), 4000)
    tier.write(key(3), 0, c)
    tier.commit(key(3))
    assert read_bytes(tier, key(3)) == c.cpu().numpy().tobytes()
    assert torch.equal(torch.as_tensor(tier.device_array(key(3)), device="cuda").view(torch.float32), c)


def test_ipc_handle_is_a_cuda_ipc_handle(tier):
    tier.reserve(key(1), 10)
    tier.write(key(1), 0, b"0123456789")
    tier.commit(key(1))
    h = tier.ipc_handle(key(1))
    assert h.device == 0 and len(h.handle) == 64 and h.size == 10
    assert tier.device_array(key(1)).data.ptr % 4096 == 0


def test_block_read_through_cuda_ipc_by_another_process(tier):
    data = payload(7, 1 << 20)
    tier.reserve(key(0), 4096)
    tier.write(key(0), 0, bytes(4096))
    tier.commit(key(0))
    tier.reserve(key(7), len(data))
    tier.write(key(7), 0, data)
    tier.commit(key(7))
    h = tier.ipc_handle(key(7))
    assert h.offset > 0
    script = textwrap.dedent("""
        import hashlib, json, sys
        import cupy
        from kvstore.client.ipc import close_attachments, open_block
        from tiers.base import IpcHandle
        d = json.loads(sys.argv[1])
        arr = open_block(IpcHandle(bytes.fromhex(d["handle"]), d["offset"], d["size"], d["device"]))
        print(hashlib.sha256(cupy.asnumpy(arr).tobytes()).hexdigest(), arr.size)
        del arr
        close_attachments()
    """)
    arg = json.dumps({"handle": h.handle.hex(), "offset": h.offset, "size": h.size, "device": h.device})
    res = subprocess.run([sys.executable, "-c", script, arg], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    digest, size = res.stdout.split()
    assert digest == hashlib.sha256(data).hexdigest() and int(size) == len(data)
