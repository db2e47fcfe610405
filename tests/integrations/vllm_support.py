"""Test support for the vLLM connector: a tiny Llama checkpoint, vLLM configs and requests, and
a daemon in its own process (:class:`DaemonProcess`) for the fault scenarios.

Not a test module. Everything here imports vLLM lazily; tests skip when it is absent.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

from kvstore.client.client import KVStoreClient
from kvstore.common.errors import KVStoreError

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))   # runners outside pytest: tests/support
from support.toml_config import write_toml  # noqa: E402


def tiny_llama_dir(path: pathlib.Path, *, layers: int = 2, kv_heads: int = 2, heads: int = 4,
                   hidden: int = 256, vocab: int = 32000, seed: int = 0, head_dim: int | None = None,
                   intermediate: int | None = None) -> pathlib.Path:
    """Save a seeded random Llama (``save_pretrained``) under ``path``; returns it. ``head_dim``
    (default ``hidden // heads``) may be set apart from the hidden size, and ``intermediate``
    (default ``2 * hidden``): a model whose KV is large for its compute."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim or hidden // heads, max_position_embeddings=4096, torch_dtype="float32")
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    return path


def kv_transfer_config(target: str, **extra):
    """The connector's transfer config. The lookup deadline is generous (60 s, not the
    50 ms default) unless given: a test that asserts hits must not miss on a loaded machine."""
    from vllm.config import KVTransferConfig

    extra = {"lookup_timeout_s": 60.0, **extra}
    return KVTransferConfig(kv_connector="KVStoreConnector",
                            kv_connector_module_path="engine_adapter.vllm.connector",
                            kv_role="kv_both", kv_connector_extra_config={"target": target, **extra})


def vllm_config(model_dir: pathlib.Path, target: str, *, block_size: int = 16, num_blocks: int = 64,
                model_kw: dict | None = None, cache_kw: dict | None = None, **extra):
    """A VllmConfig of the tiny model with the connector (no device needed); ``model_kw`` and
    ``cache_kw`` go to vLLM's ``ModelConfig`` and ``CacheConfig`` (e.g. ``hf_overrides``,
    ``quantization``, ``cache_dtype``)."""
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig

    model = ModelConfig(**{"model": str(model_dir), "skip_tokenizer_init": True, "dtype": "float32", "seed": 0,
                           "max_model_len": 2048, **(model_kw or {})})
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=True, **(cache_kw or {}))
    cache.num_gpu_blocks = num_blocks
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=2048,
                            is_encoder_decoder=False)
    return VllmConfig(model_config=model, cache_config=cache, scheduler_config=sched, device_config=DeviceConfig(device="cpu"),
                      kv_transfer_config=kv_transfer_config(target, **extra))


def scheduler(cfg, num_blocks: int = 64):
    """vLLM's real v1 Scheduler over one full-attention KV cache group."""
    import torch
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model = cfg.model_config
    names = [f"model.layers.{i}.self_attn.attn" for i in range(model.get_num_layers(cfg.parallel_config))]
    spec = FullAttentionSpec(block_size=cfg.cache_config.block_size,
                             num_kv_heads=model.get_total_num_kv_heads(),
                             head_size=model.get_head_size(), dtype=torch.float32)
    kv_cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    return Scheduler(vllm_config=cfg, kv_cache_config=kv_cfg, structured_output_manager=StructuredOutputManager(cfg),
                     block_size=cfg.cache_config.block_size, log_stats=True)


def request(req_id: str, tokens: list[int], block_size: int, max_tokens: int = 4):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Request(req_id, list(tokens), params, None, block_hasher=get_request_block_hasher(block_size, sha256))


# ------------------------------------------------------------------ a daemon in its own process

write_daemon_toml = write_toml
"""A daemon config (nested dicts of str / int / float / bool) as TOML tables."""


class DaemonProcess:
    """``kvstore serve --config FILE`` (the README's command) in its own process, with the
    signals the fault scenarios send it.

    Args:
        config: the TOML file; address: the gRPC target it serves (``unix:...``);
        log_path: the daemon's stdout and stderr (appended; shown when it fails to start).
    """

    def __init__(self, config: pathlib.Path, address: str, log_path: pathlib.Path):
        self.config, self.address, self.log_path = config, address, log_path
        self.proc = None

    def start(self, timeout_s: float = 120.0) -> float:
        """Start it and wait until it answers; returns ``time.monotonic()`` when it first did.
        Raises RuntimeError (with its log) when it exits or does not answer in time."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvstore.tools.cli", "serve", "--config",
                                          str(self.config)], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.answers(5.0):
                return time.monotonic()
            time.sleep(0.01)
        raise RuntimeError(f"daemon not ready after {timeout_s} s:\n{self.log_tail()}")

    def answers(self, timeout_s: float) -> bool:
        """Whether it answers an Info within ``timeout_s`` seconds (a fresh gRPC client, not
        waiting for a connection that is refused: a socket file nobody serves is a quick no,
        one being served gets ``timeout_s`` for the handshake on a loaded machine)."""
        client = KVStoreClient(self.address, timeout=timeout_s, shared_memory=False)
        try:
            client.info(timeout_s)
            return True
        except KVStoreError:
            return False
        finally:
            client.close()

    def counters(self) -> dict[str, int]:
        """The daemon's Stats counters now (a fresh gRPC client; the daemon must be running)."""
        with KVStoreClient(self.address, timeout=30.0, shared_memory=False) as client:
            return dict(client.stats()["counters"])

    def signal(self, sig) -> None:
        """Send ``sig`` (SIGSTOP, SIGCONT, ...) to the daemon."""
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL it (after a SIGCONT: a stopped process is killed too) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(30)

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM (graceful) and wait; SIGKILL when it does not stop in ``timeout_s``."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGCONT)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def counter_delta(before: dict[str, int], after: dict[str, int], *names: str) -> dict[str, int]:
    """``after - before`` of the named daemon counters (0 for a counter not reported)."""
    return {n: after.get(n, 0) - before.get(n, 0) for n in names}
