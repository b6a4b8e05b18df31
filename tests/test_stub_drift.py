"""The committed generated stubs are exactly what the protos generate (stub drift check)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_regenerating_changes_nothing(tmp_path: Path) -> None:
    protos = sorted((ROOT / "protos/xavier/v1").glob("*.proto"))
    assert protos
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{ROOT / 'protos'}",
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            f"--mypy_out={tmp_path}",
            f"--mypy_grpc_out={tmp_path}",
            *map(str, protos),
        ],
        check=True,
        capture_output=True,
        env=env,
    )
    committed = ROOT / "protos/python/xavier/v1"
    generated = sorted(p.name for p in (tmp_path / "xavier/v1").iterdir())
    assert generated == sorted(p.name for p in committed.glob("*_pb2*"))
    for name in generated:
        assert (tmp_path / "xavier/v1" / name).read_bytes() == (committed / name).read_bytes(), name
