"""Deciding whether two peers may exchange KV pages (invariant I4)."""

from __future__ import annotations

from xavier.v1 import types_pb2

from xavier_core.contract.layout import FINGERPRINT_FIELDS, KvLayout
from xavier_core.runtime.errors import LayoutMismatch

__all__ = ["differing_fields", "require_compatible"]

_MAX_SHOWN = 80


def _as_layout(value: KvLayout | types_pb2.KvLayout) -> KvLayout:
    return value if isinstance(value, KvLayout) else KvLayout.from_proto(value)


def _short(value: object) -> str:
    text = str(value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


def differing_fields(a: KvLayout | types_pb2.KvLayout, b: KvLayout | types_pb2.KvLayout) -> list[str]:
    """Names of the fingerprinted fields whose values differ, in declaration order."""
    la, lb = _as_layout(a), _as_layout(b)
    return [name for name in FINGERPRINT_FIELDS if getattr(la, name) != getattr(lb, name)]


def require_compatible(
    a: KvLayout | types_pb2.KvLayout,
    b: KvLayout | types_pb2.KvLayout,
    *,
    a_name: str = "a",
    b_name: str = "b",
) -> None:
    """Raises ``LayoutMismatch`` unless ``a`` and ``b`` have the same contract fingerprint.

    The message lists every differing field with both values; the ErrorInfo metadata carries
    ``fields`` (comma-separated names) and one ``<field>`` entry per difference
    (``"<a_name>=<value> <b_name>=<value>"``).
    """
    la, lb = _as_layout(a), _as_layout(b)
    if la.fingerprint == lb.fingerprint:
        return
    names = differing_fields(la, lb)
    shown = {
        name: f"{a_name}={_short(getattr(la, name))} {b_name}={_short(getattr(lb, name))}" for name in names
    }
    message = "KV layouts differ: " + "; ".join(f"{name}: {text}" for name, text in shown.items())
    raise LayoutMismatch(message, fields=",".join(names), **shown)
