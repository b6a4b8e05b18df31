"""Helpers of the render tests: render one host of a cluster description, read TOML, verify units."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

from xavier_core.deploy import load_cluster, render_host


def render(tmp_path: Path, text: str, host: str) -> Path:
    """Renders `host` of the cluster description `text` under `tmp_path/host`."""
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(text)
    out = tmp_path / host
    render_host(load_cluster(hosts), host, out)
    return out


def read_toml(path: Path) -> dict[str, Any]:
    with path.open("rb") as fh:
        return tomllib.load(fh)


def verify_rendered_units(tmp_path: Path, text: str, host: str) -> list[Path]:
    """Renders `host` with this venv as the install prefix and runs `systemd-analyze verify` on every unit
    `xavier.target` wants; asserts it is clean and returns the units."""
    venv = Path(sys.executable).parent.parent
    text = text.replace('prefix = "/usr/local/xavier"', f'prefix = "{venv}"')
    systemd = render(tmp_path, text, host) / "etc/systemd/system"
    wants = sorted((systemd / "xavier.target.wants").iterdir())
    for link in wants:  # verify reads instances of templates as files of their own
        shutil.copyfile(link.resolve(), tmp_path / link.name)
    for dropins in systemd.glob("*@.service.d"):  # and the drop-ins of a template beside them
        shutil.copytree(dropins, tmp_path / dropins.name)
    units = [tmp_path / link.name for link in wants]
    done = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *map(str, units)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stdout + done.stderr) == (0, "")
    return units
