"""The `ErrorReason` enum is the map of every `ErrorInfo` reason the code emits, and nothing more.

The scan reads the source with `ast` (no import, so a module that fails to import is still scanned) and
collects four patterns, which are every way the code names a reason today:

- a string constant passed as the `reason=` keyword to a call of an error class (any class that defines a
  `reason` attribute, or one of the base names below), whatever its spelling;
- an UPPER_SNAKE string constant passed as `reason=` to any other call (helpers that forward it); other
  strings there are free-text abort reasons of room RPCs, not ErrorInfo reasons;
- a class attribute `reason = "..."` (the class default a raise without `reason=` emits);
- a comparison of an attribute `.reason` with string constants (code that branches on a reason must
  branch on a declared one).

A new reason therefore fails the first test until it is declared in `protos/xavier/v1/error_reason.proto`,
and a declared reason that nothing emits fails the second unless it sits in `KEPT_FOR_CLIENTS` with why.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from xavier.v1 import error_reason_pb2

from xavier_core.runtime.errors import (
    DECLARED_REASONS,
    GenericError,
    InvalidArgument,
    NotFound,
    Unavailable,
    XavierError,
    error_for_code,
    wire_reason,
    wire_reasons,
)

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("xavier_core", "services", "clients")
_UPPER_SNAKE = re.compile(r"[A-Z][A-Z0-9_]*")
_PREFIX = "ERROR_REASON_"
# Error bases whose subclasses may live in other modules than the one being scanned.
_ERROR_BASES = {"XavierError", "GenericError"}

# Declared reasons that no `reason=` literal emits, each kept on purpose.
KEPT_FOR_CLIENTS = {
    # `GenericError` and the SDK's `XavierError` take the status code's name as the reason when a status
    # carries no ErrorInfo: the channel's own deadline and cancellation reach clients this way.
    "DEADLINE_EXCEEDED",
    "CANCELLED",
}


@dataclass(frozen=True)
class Use:
    """One place that names a reason."""

    reason: str
    where: str


def declared() -> set[str]:
    """The wire reasons the enum declares (value names without the prefix; the zero value excluded)."""
    names = error_reason_pb2.ErrorReason.keys()
    return {n.removeprefix(_PREFIX) for n in names if n != "ERROR_REASON_UNSPECIFIED"}


def _sources() -> Iterator[tuple[str, ast.Module]]:
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            yield str(path.relative_to(ROOT)), ast.parse(path.read_text(), filename=str(path))


def _callee(node: ast.Call) -> str:
    func = node.func
    if isinstance(func, ast.Name):
        return func.id
    return func.attr if isinstance(func, ast.Attribute) else ""


def _class_reason(node: ast.ClassDef) -> str | None:
    for stmt in node.body:
        target = stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else None
        if isinstance(stmt, ast.AnnAssign):
            target = stmt.target
        value = getattr(stmt, "value", None)
        if isinstance(target, ast.Name) and target.id == "reason" and isinstance(value, ast.Constant):
            return str(value.value)
    return None


def _compared(node: ast.Compare) -> Iterator[str]:
    sides = [node.left, *node.comparators]
    if not any(isinstance(s, ast.Attribute) and s.attr == "reason" for s in sides):
        return
    for side in sides:
        elts = side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set) else [side]
        for elt in elts:
            if isinstance(elt, ast.Constant) and isinstance(elt.value, str):
                yield elt.value


def scan(sources: list[tuple[str, ast.Module]]) -> tuple[list[Use], list[Use]]:
    """Returns (emitted, compared) reason uses in the given modules."""
    error_classes = set(_ERROR_BASES)
    for _, tree in sources:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and _class_reason(node) is not None:
                error_classes.add(node.name)
    emitted: list[Use] = []
    compared: list[Use] = []
    for where, tree in sources:
        for node in ast.walk(tree):
            at = f"{where}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ClassDef) and (reason := _class_reason(node)) is not None:
                emitted.append(Use(reason, at))
            elif isinstance(node, ast.Call):
                for kw in node.keywords:
                    if kw.arg != "reason" or not isinstance(kw.value, ast.Constant):
                        continue
                    value = kw.value.value
                    if not isinstance(value, str):
                        continue
                    if _callee(node) in error_classes or _UPPER_SNAKE.fullmatch(value):
                        emitted.append(Use(value, at))
            elif isinstance(node, ast.Compare):
                compared.extend(Use(r, at) for r in _compared(node))
            elif isinstance(node, ast.Assign) and (reason := _reason_constant(node)) is not None:
                emitted.append(Use(reason, at))
    return emitted, compared


def _reason_constant(node: ast.Assign) -> str | None:
    """A named reason constant, `INVALID_SAMPLING = "INVALID_SAMPLING"`, as modules that pass reasons
    around as values declare them."""
    if len(node.targets) != 1 or not isinstance(node.targets[0], ast.Name):
        return None
    value = node.value
    if not isinstance(value, ast.Constant) or not isinstance(value.value, str):
        return None
    name = node.targets[0].id
    return name if name == value.value and _UPPER_SNAKE.fullmatch(name) else None


@pytest.fixture(scope="module")
def uses() -> tuple[list[Use], list[Use]]:
    return scan(list(_sources()))


def test_every_emitted_reason_is_declared(uses: tuple[list[Use], list[Use]]) -> None:
    emitted, compared = uses
    known = declared()
    missing = sorted({f"{u.reason} ({u.where})" for u in [*emitted, *compared] if u.reason not in known})
    assert not missing, f"reasons not declared in protos/xavier/v1/error_reason.proto: {missing}"


def test_every_declared_reason_is_emitted_or_kept(uses: tuple[list[Use], list[Use]]) -> None:
    emitted, _ = uses
    unused = declared() - {u.reason for u in emitted} - KEPT_FOR_CLIENTS
    assert not unused, f"declared reasons that nothing emits (remove them or keep them with a why): {unused}"


def test_kept_reasons_are_declared() -> None:
    assert KEPT_FOR_CLIENTS <= declared()


def test_reason_names_are_upper_snake() -> None:
    assert all(_UPPER_SNAKE.fullmatch(r) for r in declared())


def test_scan_finds_each_pattern() -> None:
    """The scanner itself: each pattern is found, free-text abort reasons are not."""
    code = (
        "class Boom(XavierError):\n    reason = 'BOOM'\n"
        "def f(err):\n"
        "    raise Boom('x', reason='lower ok for error classes')\n"
        "    helper(reason='FORWARDED')\n"
        "    abort_room(1, reason='client went away')\n"
        "    if err.reason in ('COMPARED', 'ALSO'):\n        pass\n"
    )
    emitted, compared = scan([("m.py", ast.parse(code))])
    assert {u.reason for u in emitted} == {"BOOM", "lower ok for error classes", "FORWARDED"}
    assert {u.reason for u in compared} == {"COMPARED", "ALSO"}


def test_raise_time_check_rejects_undeclared_reasons() -> None:
    assert InvalidArgument("x", reason="EMPTY_PROMPT").reason == "EMPTY_PROMPT"
    with pytest.raises(ValueError, match="NOT_A_DECLARED_REASON"):
        InvalidArgument("x", reason="NOT_A_DECLARED_REASON")
    with pytest.raises(ValueError, match="UNDECLARED_DEFAULT"):

        class _Bad(XavierError):
            reason = "UNDECLARED_DEFAULT"

    # A status received from a peer keeps whatever reason it carried: it is data, not a raise site.
    received = error_for_code(grpc.StatusCode.NOT_FOUND, "x", reason="FROM_A_NEWER_PEER")
    assert isinstance(received, NotFound) and received.reason == "FROM_A_NEWER_PEER"
    generic = error_for_code(grpc.StatusCode.DEADLINE_EXCEEDED, "late")
    assert isinstance(generic, GenericError) and generic.reason == "DEADLINE_EXCEEDED"
    assert DECLARED_REASONS == declared()


def test_the_router_compares_reasons_through_the_enum(uses: tuple[list[Use], list[Use]]) -> None:
    """The router branches on reasons it names by the generated enum (`is_reason`, `wire_reasons`): a
    literal there would compile with a typo in it and silently never match."""
    _, compared = uses
    literal = sorted(u.where for u in compared if u.where.startswith("services/xavier_services/router/"))
    assert not literal, f"reason compared with a string literal: {literal}"


def test_reasons_named_by_the_enum_match_their_wire_names() -> None:
    err = Unavailable("x", reason="PEER_UNAVAILABLE")
    assert err.is_reason(error_reason_pb2.ERROR_REASON_PEER_UNAVAILABLE)
    assert err.is_reason(
        error_reason_pb2.ERROR_REASON_NO_PEERS, error_reason_pb2.ERROR_REASON_PEER_UNAVAILABLE
    )
    assert not err.is_reason(error_reason_pb2.ERROR_REASON_UNAVAILABLE)
    assert not err.is_reason()
    # A status without an ErrorInfo carries its code's name, which is a declared reason too.
    bare = error_for_code(grpc.StatusCode.UNAVAILABLE, "refused")
    assert bare.is_reason(error_reason_pb2.ERROR_REASON_UNAVAILABLE)
    # A reason from a newer peer is kept and matches nothing this build names.
    newer = error_for_code(grpc.StatusCode.NOT_FOUND, "x", reason="FROM_A_NEWER_PEER")
    assert not any(newer.is_reason(v) for v in error_reason_pb2.ErrorReason.values() if v)
    assert wire_reasons(error_reason_pb2.ERROR_REASON_PEER_FAILED) == {"PEER_FAILED"}
    assert {wire_reason(v) for v in error_reason_pb2.ErrorReason.values() if v} == DECLARED_REASONS
    with pytest.raises(ValueError, match="travels"):
        wire_reason(error_reason_pb2.ERROR_REASON_UNSPECIFIED)
