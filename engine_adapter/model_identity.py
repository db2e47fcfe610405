"""What names a model's KV in the store namespace besides its shape: the weights and the config
fields that change what attention reads.

Two checkpoints of one architecture with different weights write different KV for the same
tokens, and so do one checkpoint's weights under another RoPE base or scaling, sliding window
or quantization. The plug-ins put all of it in the namespace (``Namespace.extra``), so a
mismatch is a miss, never a hit.

The weights' identity (:func:`weights_identity`) is computed once at start and is cheap:

- an explicit identity (a commit hash or checkpoint version the operator gives) is used as is;
- a file of a Hugging Face hub cache snapshot is a link to ``blobs/<hash of its content>``
  (SHA-256 for large files, the git blob SHA-1 otherwise): the blob names are the identity,
  and no byte of the weights is read;
- a ``.safetensors`` file is named by its size, its header (8 bytes giving the header
  length, then the JSON of every tensor's name, dtype, shape and byte offsets) and, per
  tensor, :data:`SAMPLES` samples of :data:`SAMPLE_BYTES` bytes evenly spaced over its data
  (the first and the last included): at most 16 KiB of each tensor, never all the weights.
  The header alone names the shapes, not the values: two same-shape checkpoints have equal
  headers, so the samples are what tells their weights apart;
- other weight files (``.bin``, ``.pt``, ``.pth``, ``.gguf``): size and 16 samples;
- ``config.json`` and ``*.safetensors.index.json`` are hashed whole.

The fingerprint is a SHA-256 over the files in name order, so it is the same in every
process and on every machine that holds the same files. A checkpoint that cannot be found or
read gives an empty identity and the reason; the namespace then covers only what is known,
and the plug-in says so once at start (:func:`describe`).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import struct
from dataclasses import dataclass
from typing import Any, Mapping

from kvstore.common.keys import ExtraValue, Namespace

SAMPLES = 4
"""Samples of each tensor's bytes in a safetensors fingerprint."""
SAMPLE_BYTES = 4096
"""Bytes of one sample."""
_FILE_SAMPLES = 16
_MAX_HEADER = 100 << 20               # the safetensors format's own limit on the header size
_DOMAIN = b"kvstore.weights.v1"
_BLOB = re.compile(r"^(?:[0-9a-f]{40}|[0-9a-f]{64})$")
_OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".gguf")

ATTENTION_FIELDS = (
    "model_type", "architectures", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "max_position_embeddings", "partial_rotary_factor", "sliding_window", "use_sliding_window",
    "max_window_layers", "layer_types", "attention_chunk_size", "rms_norm_eps", "layer_norm_eps", "hidden_act",
    "attention_bias", "qkv_bias", "use_qk_norm", "attn_logit_softcapping", "query_pre_attn_scalar",
    "attention_multiplier", "embedding_multiplier", "quantization_config",
)
"""Hugging Face config fields the plug-ins put in the namespace (those a config has), besides
the RoPE parameters (:func:`rope_parameters`)."""


@dataclass(frozen=True)
class WeightsIdentity:
    """The weights' part of a namespace.

    Attributes:
        value: ``"sha256:<64 hex>"`` (a checkpoint fingerprint), ``"revision:<r>"``,
            ``"seed:<...>"``, ``"dummy"``; ``""`` when the weights are not known.
        source: what ``value`` was computed from, or why it is empty, in words.
    """

    value: str
    source: str


def canonical(value: Any) -> str:
    """Compact JSON of ``value`` with sorted keys: the same text for equal values in any
    process (tuples are lists; objects that are not JSON are their ``repr``)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr)


def _get(config: Any, name: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(name)
    return getattr(config, name, None)


def rope_parameters(config: Any) -> dict | None:
    """The RoPE parameters of a Hugging Face config (object or dict), one spelling for all
    transformers releases: ``rope_parameters`` or ``rope_scaling`` merged with a top-level
    ``rope_theta`` (kept apart as ``rope_theta_attribute`` when the two differ); ``type`` read
    as ``rope_type``; numbers as floats; ``rope_type: default``
    left out. ``None`` when the config names no RoPE parameter."""
    rope = _get(config, "rope_parameters") or _get(config, "rope_scaling") or {}
    if not isinstance(rope, Mapping):
        rope = {"value": repr(rope)}
    out = dict(rope)
    nested = bool(out) and all(isinstance(v, Mapping) for v in out.values())
    theta = _get(config, "rope_theta")
    if theta is not None and not nested:
        if out.setdefault("rope_theta", theta) != theta:
            out["rope_theta_attribute"] = theta   # both spellings, and they differ: keep both
    if not nested:
        if "type" in out:
            out.setdefault("rope_type", out.pop("type"))
        if out.get("rope_type") == "default":
            del out["rope_type"]
        out = {k: float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
               for k, v in out.items()}
    return out or None


def attention_config(config: Any) -> str:
    """Canonical JSON (:func:`canonical`) of the config fields that change KV bytes: the RoPE
    parameters and the :data:`ATTENTION_FIELDS` the config has (``None`` ones left out).

    Args:
        config: a Hugging Face ``PretrainedConfig`` (vLLM's ``hf_text_config``) or a
            ``config.json`` dict.
    """
    fields = {name: _get(config, name) for name in ATTENTION_FIELDS}
    fields["rope"] = rope_parameters(config)
    return canonical({k: v for k, v in fields.items() if v is not None})


# ------------------------------------------------------------------ checkpoint fingerprint

def _field(h, data: bytes) -> None:
    h.update(struct.pack("<Q", len(data)))
    h.update(data)


def _blob_name(path: pathlib.Path) -> str | None:
    """The content hash a hub cache link names (``.../blobs/<hex>``), else None."""
    if not path.is_symlink():
        return None
    target = pathlib.Path(os.readlink(path))
    return target.name if target.parent.name == "blobs" and _BLOB.match(target.name) else None


def _spread(begin: int, end: int, n: int) -> list[tuple[int, int]]:
    """``n`` ranges of :data:`SAMPLE_BYTES` evenly spaced over ``[begin, end)``, merged where
    they overlap (the whole range when it is short)."""
    length = end - begin
    if length <= n * SAMPLE_BYTES:
        return [(begin, length)] if length > 0 else []
    step = (length - SAMPLE_BYTES) // (n - 1)
    return [(begin + i * step, SAMPLE_BYTES) for i in range(n)]


def _hash_ranges(h, fh, ranges: list[tuple[int, int]]) -> None:
    if hasattr(os, "posix_fadvise"):     # samples, not a scan: no read-ahead around each one
        os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
    for offset, length in sorted(ranges):
        fh.seek(offset)
        data = fh.read(length)
        if len(data) != length:
            raise ValueError(f"file ends before byte {offset + length}")
        h.update(data)


def _hash_safetensors(h, path: pathlib.Path, size: int) -> None:
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) != 8:
            raise ValueError(f"{path.name}: too short for a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - 8):
            raise ValueError(f"{path.name}: header of {n} bytes in a {size}-byte file")
        header = fh.read(n)
        _field(h, header)
        base = 8 + n
        ranges: list[tuple[int, int]] = []
        for name, entry in sorted(json.loads(header).items()):
            if name == "__metadata__":
                continue
            begin, end = entry["data_offsets"]
            if not 0 <= begin <= end <= size - base:
                raise ValueError(f"{path.name}: tensor {name!r} lies outside the file")
            ranges += _spread(base + begin, base + end, SAMPLES)
        _hash_ranges(h, fh, ranges)


def _weight_files(root: pathlib.Path) -> list[pathlib.Path]:
    if root.is_file():
        return [root]
    files = sorted(p for p in root.glob("*.safetensors") if p.is_file())
    if not files:
        files = sorted(p for p in root.iterdir() if p.suffix in _OTHER_WEIGHTS and p.is_file())
    if not files:
        raise FileNotFoundError(f"no weight files (*.safetensors, {', '.join(_OTHER_WEIGHTS)}) in {str(root)!r}")
    return files + sorted(p for p in root.iterdir() if p.name == "config.json" or p.name.endswith(".index.json"))


def fingerprint_checkpoint(path: str | os.PathLike) -> tuple[str, str]:
    """SHA-256 fingerprint of a checkpoint folder (or one weight file), see the module docstring.

    Returns:
        ``("sha256:<64 hex>", what was read, in words)``.
    Raises:
        FileNotFoundError: no weight file there.
        OSError: a file cannot be read.
        ValueError: a malformed safetensors header.
    """
    root = pathlib.Path(path)
    h = hashlib.sha256(_DOMAIN)
    blobs = sampled = whole = 0
    for f in _weight_files(root):
        size = f.stat().st_size
        _field(h, f.name.encode("utf-8"))
        h.update(struct.pack("<Q", size))
        blob = _blob_name(f)
        if blob is not None:
            _field(h, b"blob:" + blob.encode())
            blobs += 1
        elif f.name.endswith(".json"):
            _field(h, f.read_bytes())
            whole += 1
        elif f.suffix == ".safetensors":
            _hash_safetensors(h, f, size)
            sampled += 1
        else:
            with open(f, "rb") as fh:
                _hash_ranges(h, fh, _spread(0, size, _FILE_SAMPLES))
            sampled += 1
    parts = [f"{blobs} hub blob hashes"] if blobs else []
    if sampled:
        parts.append(f"{sampled} weight files (headers and sampled bytes)")
    if whole:
        parts.append(f"{whole} JSON files")
    return "sha256:" + h.hexdigest(), f"checkpoint {str(root)!r}: " + ", ".join(parts)


def _hub_snapshot(repo_id: str, revision: str | None, cache_dir: str | None) -> pathlib.Path | None:
    """The local hub cache folder of ``repo_id`` at ``revision`` (no network), or None."""
    try:
        from huggingface_hub import snapshot_download

        return pathlib.Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                              local_files_only=True))
    except Exception:  # noqa: BLE001 - not installed, not cached, not a repo id: not found
        return None


def local_checkpoint(model: str, revision: str | None = None, cache_dir: str | None = None) -> pathlib.Path | None:
    """The local checkpoint folder (or weight file) of ``model``: the path itself when it
    exists, else the hub cache snapshot of repo id ``model`` at ``revision`` (no network);
    None when neither is there."""
    if not model:
        return None
    path = pathlib.Path(model)
    return path if path.exists() else _hub_snapshot(model, revision, cache_dir)


def weights_identity(model: str, *, revision: str | None = None, explicit: str = "",
                     cache_dir: str | None = None, load_format: str = "auto") -> WeightsIdentity:
    """The weights' identity of a model given by path or hub repo id (computed now, once).

    Args:
        model: checkpoint folder or weight file, or a Hugging Face repo id (its local hub
            cache snapshot is read, never the network).
        revision: the engine's weights revision (hub branch, tag or commit), if any.
        explicit: an identity the operator gave; used as is, no file is read.
        cache_dir: the hub cache folder the engine downloads into (None: the default).
        load_format: the engine's load format; ``"dummy"`` (random weights) is its own identity.
    Returns:
        The identity; ``value`` is empty when neither the files nor a revision are known
        (``source`` says why). Never raises for a missing or unreadable checkpoint.
    """
    if explicit:
        return WeightsIdentity(f"revision:{explicit}", "the configured weights revision")
    if load_format == "dummy":
        return WeightsIdentity("dummy", "random dummy weights (load format 'dummy')")
    local = local_checkpoint(model, revision, cache_dir)
    problem = f"no checkpoint files found for {model!r}"
    if local is not None:
        try:
            value, source = fingerprint_checkpoint(local)
            return WeightsIdentity(value, source)
        except (OSError, ValueError, KeyError, TypeError) as e:
            problem = f"checkpoint {str(local)!r} not readable ({e})"
    if revision:
        return WeightsIdentity(f"revision:{revision}", f"revision {revision!r} only: {problem}")
    return WeightsIdentity("", problem)


def model_extra(weights: WeightsIdentity, **fields: ExtraValue | None) -> dict[str, ExtraValue]:
    """Namespace ``extra`` entries of a model: ``weights`` (when known) and each of ``fields``
    that is not None or empty."""
    out: dict[str, ExtraValue] = {"weights": weights.value} if weights.value else {}
    out.update({k: v for k, v in fields.items() if v not in (None, "", "{}", "[]")})
    return out


def describe(namespace: Namespace, weights: WeightsIdentity, engine: str) -> str:
    """One line for the start-up log: what the namespace was built from.

    When the weights are not known it says that blocks are then shared with any checkpoint
    served under the same model id, and how to tell them apart.
    """
    extra = dict(namespace.extra)
    fields = ", ".join(f"{k}={v!r}" for k, v in sorted(extra.items()) if k != "weights")
    if weights.value:
        who = f"weights {weights.value} ({weights.source})"
    else:
        who = (f"weights NOT fingerprinted ({weights.source}): blocks are shared with any checkpoint "
               f"served as model {namespace.model!r}; set the weights revision to tell checkpoints apart")
    return (f"kvstore namespace {namespace.fingerprint().hex()[:16]} of this {engine}: model {namespace.model!r}, "
            f"KV dtype {namespace.dtype}, {namespace.block_tokens}-token blocks, layout {namespace.layout}, "
            f"tenant {namespace.tenant!r}, {who}; {fields}")
