"""`xavier`: run the mesh locally and talk to it.

xavier up [--model DIR] [--mode pd|colocated|native] [--prefill N --decode N --unified N]
          [--grpc HOST:PORT] [--http HOST:PORT] [--compute model|null] [--workdir DIR] [--insecure]
          [--no-pagestore] [--engine reference|sglang] [--gpus LIST] [--sglang-arg ARG ...]
xavier generate "prompt" [--stream] [--mode pd|colocated|native] [--address HOST:PORT]
xavier status [--address HOST:PORT] [--pagestore HOST:PORT] [--json] [--ca F --cert F --key F]
xavier models make-tiny DIR --arch qwen2|qwen3|llama [...]
xavier deploy render --hosts FILE --host NAME --out DIR [--units DIR]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("xavier")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _parser() -> argparse.ArgumentParser:
    from xavier_cli.commands import add_generate_args, add_status_args
    from xavier_cli.up import add_up_args

    p = argparse.ArgumentParser(
        prog="xavier",
        description="Xavier LLM serving mesh",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"xavier {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    fmt = argparse.ArgumentDefaultsHelpFormatter
    add_up_args(sub.add_parser("up", help="start the whole mesh locally", formatter_class=fmt))
    add_generate_args(sub.add_parser("generate", help="generate an answer", formatter_class=fmt))
    add_status_args(sub.add_parser("status", help="peers, rooms, pages, page store", formatter_class=fmt))
    sub.add_parser("deploy", help="render systemd units and configs for a host", add_help=False)
    models = sub.add_parser("models", help="model utilities")
    msub = models.add_subparsers(dest="models_command", required=True)
    msub.add_parser("make-tiny", help="write a tiny random checkpoint", add_help=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["models", "make-tiny"]:
        from xavier_core.engine.tiny import make_tiny_main

        return make_tiny_main(argv[2:])
    if argv[:1] == ["deploy"]:
        from xavier_core.deploy.__main__ import main as deploy_main

        return deploy_main(argv[1:], prog="xavier deploy")
    args = _parser().parse_args(argv)
    if args.command == "up":
        from xavier_cli.up import run_up

        return run_up(args)
    if args.command == "generate":
        from xavier_cli.commands import run_generate

        return run_generate(args)
    from xavier_cli.commands import run_status

    return run_status(args)


if __name__ == "__main__":
    raise SystemExit(main())
