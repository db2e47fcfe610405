"""``kvstore explain``: why a prompt misses the store (:mod:`kvstore.service.explain`).

    kvstore explain STORED.json MISSED.json [--namespace NS.json] [--window 8] [--tokenizer NAME]
    kvstore explain PROMPT.json --target unix:kvstore-data/kvstore.sock [--namespace NS.json]

A prompt file is JSON: a list of token ids, or an object with ``tokens`` (token ids) or
``keys`` (64-hex block keys), and optionally ``namespace`` (the fields of
:class:`kvstore.common.keys.Namespace`) and ``extra`` (per-block extra keys). ``--namespace``
gives the namespace of prompts that have none. With one prompt and ``--target`` the
daemon answers from its state (evicted when, from which tier, by which policy; refused
at admission; never stored); that needs a daemon with the Explain RPC.

A prompt shorter than one block holds no full block: nothing of it is stored or looked
up. When no prompt given has a full block there is no miss to explain; the command says
so (exit status 0) and asks no daemon. When only one of two prompts has full blocks they
are compared as usual (a namespace that differs, block 0 in only one prompt).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any, Callable, Sequence

from kvstore.common.errors import KVStoreError
from kvstore.service.explain import Explanation, Prompt, explain_pair
from kvstore.common.keys import Namespace
from kvstore.tools.cliargs import address, non_empty_path, non_negative_int
from kvstore.tools.trace import loads_json, not_json


class PromptError(ValueError):
    """A prompt or namespace file is unreadable or malformed (the message names the file)."""


def _namespace(obj: Any, where: str) -> Namespace:
    if not isinstance(obj, dict):
        raise PromptError(f"{where}: namespace must be an object with model, dtype, layout, block_tokens")
    try:
        return Namespace(**obj)
    except (TypeError, ValueError) as e:
        raise PromptError(f"{where}: bad namespace: {e}") from None


def load_prompt(path: str, default_ns: Namespace | None) -> Prompt:
    """Read one prompt file (see the module docstring). Raises PromptError."""
    try:
        text = pathlib.Path(path).read_text(encoding="utf-8")
        obj = loads_json(text)
    except (OSError, UnicodeDecodeError) as e:
        raise PromptError(f"cannot read {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise PromptError(not_json(f"{path}:{e.lineno}", text.splitlines()[e.lineno - 1] if text.strip() else text, e,
                                   'a JSON list of token ids, or an object with "tokens" or "keys"')) from None
    if isinstance(obj, list):
        obj = {"tokens": obj}
    if not isinstance(obj, dict):
        raise PromptError(f"{path}: expected a list of token ids or an object")
    ns = _namespace(obj["namespace"], path) if "namespace" in obj else default_ns
    tokens = keys = None
    if "tokens" in obj:
        t = obj["tokens"]
        if not isinstance(t, list) or any(isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < 1 << 32
                                          for x in t):
            raise PromptError(f"{path}: tokens must be a list of token ids in [0, 2**32)")
        if ns is None:
            raise PromptError(f"{path}: token ids need a namespace (in the file or --namespace)")
        tokens = tuple(t)
    elif "keys" in obj:
        k = obj["keys"]
        try:
            keys = tuple(bytes.fromhex(x) for x in k)
        except (TypeError, ValueError):
            raise PromptError(f"{path}: keys must be a list of hex strings") from None
        if any(len(x) != 32 for x in keys):
            raise PromptError(f"{path}: block keys are 32 bytes (64 hex digits)")
    else:
        raise PromptError(f"{path}: needs 'tokens' or 'keys'")
    return Prompt(tokens, keys, ns, obj.get("extra"))


def _decoder(name: str | None) -> Callable[[Sequence[int]], str] | None:
    if not name:
        return None
    if name == "bytes":
        return lambda ids: bytes(i for i in ids if i < 256).decode("utf-8", "replace")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise PromptError("--tokenizer needs the transformers package") from None
    try:
        tok = AutoTokenizer.from_pretrained(name)
    except Exception as e:   # noqa: BLE001 - any load failure is a user error here
        raise PromptError(f"cannot load tokenizer {name!r}: {e}") from None
    return lambda ids: tok.decode(list(ids))


def explain_remote(prompt: Prompt, target: str) -> Explanation:
    """One prompt against a daemon's state (the Explain RPC through ``client.explain``)."""
    from kvstore.client.client import KVStoreClient

    keys = prompt.block_keys()
    with KVStoreClient(target) as client:
        return client.explain(keys)


def no_full_block(path: str, prompt: Prompt) -> str:
    """The answer for a prompt without a full block (:meth:`Prompt.block_keys` is empty)."""
    if prompt.tokens is None:
        return f"{path} holds no block key: nothing to look up, so no miss to explain"
    bt = prompt.namespace.block_tokens if prompt.namespace is not None else "?"
    return (f"{path} holds no full block ({len(prompt.tokens)} tokens, blocks of {bt}): nothing of it is "
            f"stored or looked up, so no miss to explain")


def cmd_explain(args: argparse.Namespace) -> int:
    try:
        default_ns = None
        if args.namespace:
            try:
                default_ns = _namespace(loads_json(pathlib.Path(args.namespace).read_text()), args.namespace)
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise PromptError(f"cannot read namespace {args.namespace}: {e}") from None
        prompts = [load_prompt(p, default_ns) for p in args.prompts]
        if len(prompts) > 2 or len(prompts) == 1 and not args.target:
            raise PromptError("give two prompts, or one prompt and --target ADDR")
        if not any(prompt.block_keys() for prompt in prompts):   # else compare: the other has blocks
            print(no_full_block(args.prompts[0], prompts[0]) if len(prompts) == 1
                  else "; ".join(no_full_block(path, prompt) for path, prompt in zip(args.prompts, prompts)))
            return 0
        if len(prompts) == 2:
            result = explain_pair(prompts[0], prompts[1], window=args.window, decode=_decoder(args.tokenizer))
        else:
            result = explain_remote(prompts[0], args.target)
    except (PromptError, ValueError, KVStoreError) as e:
        print(f"kvstore explain: {e}", file=sys.stderr)
        return 2
    print(result.text)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("explain", help="say why a prompt misses: first missing block and the reason",
                       description="Compare two prompts (token ids or block keys), or one prompt with a daemon's "
                                   "state, and name the first block that misses and why.")
    p.add_argument("prompts", nargs="+", metavar="PROMPT.json", help="one or two prompt files")
    p.add_argument("--namespace", type=non_empty_path,
                   help="a JSON file holding the namespace (model, dtype, layout, block_tokens, ...) of prompts "
                        "that carry none")
    p.add_argument("--target", type=address, help="daemon address, with one prompt")
    p.add_argument("--window", type=non_negative_int, default=8, help="tokens shown on each side of a difference (default 8)")
    p.add_argument("--tokenizer", help="show token windows as text: 'bytes' (UTF-8 byte ids) or a "
                                       "Hugging Face tokenizer name or path")
    p.set_defaults(func=cmd_explain)
