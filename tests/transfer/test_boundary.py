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
