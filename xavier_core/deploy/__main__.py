"""Render one host's systemd units, environment files and service configs from a cluster description
(a TOML file: see deploy/examples/hosts.toml and docs/deploy.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from xavier_core.runtime.config import ConfigError, exit_on_config_error

from .hosts import load_cluster
from .render import DEFAULT_UNITS_DIR, render_host


def main(argv: list[str] | None = None, prog: str = "python -m xavier_core.deploy") -> int:
    """Render one host's units and configs; a bad description exits 2 naming the key."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    render = commands.add_parser("render", help="write a host's units, env files and configs")
    render.add_argument(
        "--hosts", type=Path, required=True, metavar="FILE", help="cluster description (TOML)"
    )
    render.add_argument("--host", required=True, metavar="NAME", help="the [hosts] entry to render")
    render.add_argument("--out", type=Path, required=True, metavar="DIR", help="output root (mirrors /)")
    render.add_argument("--units", type=Path, default=DEFAULT_UNITS_DIR, metavar="DIR", help="unit files")
    args = parser.parse_args(argv)
    try:
        written = render_host(load_cluster(args.hosts), args.host, args.out, args.units)
    except ConfigError as err:
        exit_on_config_error(err)
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
