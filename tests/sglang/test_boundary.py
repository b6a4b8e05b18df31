"""The SGLang adapter runs inside SGLang's processes: it uses the core (directory client, room feed,
transfer layer), never a Xavier service package, which an SGLang install need not carry."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "engines" / "xavier_sglang"


def _absolute_imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def test_the_adapter_imports_no_service_package() -> None:
    modules = sorted(PACKAGE.glob("*.py"))
    assert len(modules) >= 8  # the walk found the package
    bad = [
        f"{path.name}: {name}"
        for path in modules
        for name in _absolute_imports(path)
        if name == "xavier_services" or name.startswith("xavier_services.")
    ]
    assert not bad, "the SGLang adapter must not import a service:\n" + "\n".join(bad)
