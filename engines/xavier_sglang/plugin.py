"""The SGLang plugin: makes `--disaggregation-transfer-backend xavier` a real choice.

SGLang's transfer backends are a closed enum (`sglang.srt.disaggregation.utils.TransferBackend`) and an
if/elif chain (`get_kv_class`) that raises `ValueError` for anything else. SGLang loads this plugin (entry
point group `sglang.srt.plugins`, name `xavier`, allow-listed with `SGLANG_PLUGINS=xavier`) in the
launcher before it parses arguments, and again in every scheduler, DP-controller and detokenizer process.
`register` then, through SGLang's own `HookRegistry`:

- widens the CLI choices of `--disaggregation-transfer-backend` with `xavier`;
- replaces `TransferBackend` (REPLACE) with an enum that has every original member plus `XAVIER`; the
  registry also rebinds the modules that imported the old class by name;
- wraps `get_kv_class` (AROUND): for `XAVIER` it returns `conn`'s manager, sender, receiver and bootstrap
  server (and SGLang's own `KVArgs`); any other backend goes to the original.

A process not configured for Xavier (neither `XAVIER_DIRECTORY` in the environment nor the xavier
backend on its command line) is left exactly as it was: nothing is registered, nothing is imported.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable
from typing import Any

from .config import xavier_configured

__all__ = ["BACKEND", "register", "xavier_transfer_backend"]

BACKEND = "xavier"
_TRANSFER_BACKEND = "sglang.srt.disaggregation.utils.TransferBackend"
_GET_KV_CLASS = "sglang.srt.disaggregation.utils.get_kv_class"
_CLASS_NAMES = {
    "manager": "XavierKVManager",
    "sender": "XavierKVSender",
    "receiver": "XavierKVReceiver",
    "bootstrap_server": "XavierKVBootstrapServer",
}
_extended: dict[type[enum.Enum], type[enum.Enum]] = {}


def register() -> None:
    """The entry point SGLang calls. Registers the hooks only in a process configured for Xavier."""
    if not xavier_configured(sys.argv):
        return
    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _add_cli_choice()
    HookRegistry.register(_TRANSFER_BACKEND, xavier_transfer_backend(utils.TransferBackend), HookType.REPLACE)
    HookRegistry.register(_GET_KV_CLASS, get_kv_class_around, HookType.AROUND)


def xavier_transfer_backend(original: type[enum.Enum]) -> type[enum.Enum]:
    """`original` with an `XAVIER = "xavier"` member added (the same class for repeated calls)."""
    if "XAVIER" in original.__members__:
        return original
    if original not in _extended:
        members = {m.name: m.value for m in original}
        members["XAVIER"] = BACKEND
        make: Any = enum.Enum  # the functional API; mypy wants a literal class name
        _extended[original] = make(
            original.__name__, members, module=original.__module__, qualname=original.__qualname__
        )
    return _extended[original]


def get_kv_class_around(original: Callable[..., Any], transfer_backend: Any, class_type: Any) -> Any:
    """The AROUND hook of `get_kv_class`: Xavier's classes for the xavier backend, else the original."""
    if getattr(transfer_backend, "value", transfer_backend) != BACKEND:
        return original(transfer_backend, class_type)
    kind = getattr(class_type, "value", class_type)
    if kind == "kvargs":
        from sglang.srt.disaggregation.base.conn import KVArgs

        return KVArgs
    name = _CLASS_NAMES.get(kind)
    if name is None:
        return None
    from . import conn

    return getattr(conn, name)


def _add_cli_choice() -> None:
    """Adds `xavier` to `--disaggregation-transfer-backend`'s choices (0.5.23 keeps them in
    `arg_groups/choices.py`, 0.5.17 in `server_args.py`)."""
    try:
        from sglang.srt.arg_groups import choices
    except ImportError:
        from sglang.srt import server_args as choices
    if BACKEND not in choices.DISAGG_TRANSFER_BACKEND_CHOICES:
        choices.add_disagg_transfer_backend_choices([BACKEND])
