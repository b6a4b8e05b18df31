"""The transfer layer stands alone: no module under xavier_core/transfer imports an engine or a service."""

from __future__ import annotations

import ast
from pathlib import Path

import xavier_core.transfer

FORBIDDEN = ("xavier_core.engine", "xavier_services")
PACKAGE = Path(xavier_core.transfer.__file__).parent


def _imports(tree: ast.Module) -> list[str]:
    """Every absolute module name the module imports, at any depth (function-local imports too)."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
            names.extend(f"{node.module}.{a.name}" for a in node.names)
    return names


def _forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def test_no_transfer_module_imports_an_engine_or_a_service() -> None:
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) >= 10  # the walk found the package, not an empty folder
    bad = [
        f"{path.relative_to(PACKAGE)}: {name}"
        for path in modules
        for name in _imports(ast.parse(path.read_text(), str(path)))
        if _forbidden(name)
    ]
    assert not bad, "the transfer layer must not import an engine or a service:\n" + "\n".join(bad)


def test_the_check_catches_every_import_form() -> None:
    tree = ast.parse(
        "import xavier_services.peer\n"
        "from xavier_core.engine.api import Engine\n"
        "from xavier_core import engine\n"
        "def f():\n    import xavier_core.engine.reference\n"
        "from xavier_core.engineering import x\n"
    )
    assert [n for n in _imports(tree) if _forbidden(n)] == [
        "xavier_services.peer",
        "xavier_core.engine.api",
        "xavier_core.engine.api.Engine",
        "xavier_core.engine",
        "xavier_core.engine.reference",
    ]


ROOMS = ("common", "nixl", "cuda", "staged", "port")  # bottom up, as the package docstring lists them
BELOW = {"common": set(), "nixl": {"common"}, "cuda": {"common"}, "staged": {"common", "nixl", "cuda"}}


def _room_of(name: str) -> str | None:
    parts = name.split(".")
    if parts[:2] != ["xavier_core", "transfer"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in ROOMS else None


def test_each_room_imports_only_the_rooms_below_it() -> None:
    assert sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()) == sorted(ROOMS)
    allowed = {**BELOW, "port": set(ROOMS) - {"port"}}
    bad = [
        f"{path.relative_to(PACKAGE)}: {name}"
        for room in ROOMS
        for path in sorted((PACKAGE / room).glob("*.py"))
        for name in _imports(ast.parse(path.read_text(), str(path)))
        if (target := _room_of(name)) is not None and target != room and target not in allowed[room]
    ]
    assert not bad, "a room of the transfer layer imports a room above it:\n" + "\n".join(bad)


def test_the_room_check_sees_an_upward_import() -> None:
    tree = ast.parse("from xavier_core.transfer.port.kv_port import KvPort\nimport xavier_core.transfer\n")
    assert [_room_of(n) for n in _imports(tree)] == ["port", "port", None]
