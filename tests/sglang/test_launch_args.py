"""The command lines a service hosting SGLang builds (`xavier_services.sglang_host.launch`) parse with the
REAL `ServerArgs` parser of the installed SGLang, in a fresh process with the environment the service
gives it (the xavier plugin loaded by SGLang's `load_plugins()` where the service asks for it), to the
values meant; and every flag Xavier refuses in `sglang.extra_args` is one SGLang's parser knows (or a
prefix it would expand), so the deny-list is not stale.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from xavier.v1 import types_pb2

pytest.importorskip("sglang.srt.server_args", reason="the real sglang package is not installed")

from xavier_services.sglang_host.config import OWNED_FLAGS, SglangSection
from xavier_services.sglang_host.launch import Launch, LaunchSpec, build_launch

pytestmark = pytest.mark.sglang
ONLY_IN_SOME = {"--stream-output"}
"""Refused flags that only some supported releases have (0.5.17's deprecated alias, gone in 0.5.23)."""

PROBE = r"""
import argparse, json, sys
out_path, argv = sys.argv[1], sys.argv[2:]
sys.argv = ["sglang"] + argv
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
args = parser.parse_args(argv)
plain = (str, int, float, bool, type(None))
values = {k: v for k, v in vars(args).items() if isinstance(v, plain)}
json.dump({"args": values, "options": sorted(parser._option_string_actions)}, open(out_path, "w"))
"""


def parse(tmp_path: Path, plugin_path: str, launch: Launch) -> dict[str, Any]:
    out = tmp_path / "parsed.json"
    env = {k: v for k, v in os.environ.items() if k not in ("XAVIER_DIRECTORY", "SGLANG_PLUGINS")}
    if plugin_path:
        env["PYTHONPATH"] = os.pathsep.join([plugin_path, env.get("PYTHONPATH", "")])
    env.update(launch.env)
    argv = launch.argv[3:]  # after "python -m sglang.launch_server"
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(out), *argv], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _launch(model: Path, role: types_pb2.Role.ValueType, cfg: SglangSection, **kw: Any) -> Launch:
    spec = LaunchSpec(
        role=role, model=model, port=31000, advertise="127.0.0.1:7201", directory="127.0.0.1:1", **kw
    )
    return build_launch(cfg, spec)


def test_xavier_pd_argv_parses(tmp_path: Path, plugin_entry_point: str, tiny_model: Path) -> None:
    cfg = SglangSection(extra_args=["--mem-fraction-static", "0.5", "--attention-backend", "triton"])
    got = parse(tmp_path, plugin_entry_point, _launch(tiny_model, types_pb2.ROLE_PREFILL, cfg))
    a = got["args"]
    assert a["disaggregation_mode"] == "prefill" and a["disaggregation_transfer_backend"] == "xavier"
    assert a["model_path"] == str(tiny_model) and a["host"] == "127.0.0.1" and a["port"] == 31000
    assert a["api_key"] and a["page_size"] == 16 and a["mem_fraction_static"] == 0.5
    d = parse(tmp_path, plugin_entry_point, _launch(tiny_model, types_pb2.ROLE_DECODE, SglangSection()))[
        "args"
    ]
    assert d["disaggregation_mode"] == "decode" and d["disable_radix_cache"] is True
    # Structured output as the SGLang peers declare it: xgrammar, compact JSON (no free whitespace).
    for args in (a, d):
        assert (
            args["grammar_backend"] == "xgrammar" and args["constrained_json_disable_any_whitespace"] is True
        )


def test_native_and_unified_argv_parse(tmp_path: Path, plugin_entry_point: str, tiny_model: Path) -> None:
    cfg = SglangSection(transfer_backend="nixl", bootstrap_port=9100, base_gpu_id=1)
    a = parse(tmp_path, plugin_entry_point, _launch(tiny_model, types_pb2.ROLE_PREFILL, cfg))["args"]
    assert a["disaggregation_transfer_backend"] == "nixl" and a["disaggregation_bootstrap_port"] == 9100
    assert a["base_gpu_id"] == 1
    cfg = SglangSection(hicache=True)
    launch = _launch(tiny_model, types_pb2.ROLE_UNIFIED, cfg, pagestore="127.0.0.1:2", dtype="float16")
    u = parse(tmp_path, plugin_entry_point, launch)["args"]
    assert u["disaggregation_mode"] == "null" and u["enable_hierarchical_cache"] is True
    assert u["hicache_storage_backend"] == "dynamic" and u["dtype"] == "float16"
    assert json.loads(u["hicache_storage_backend_extra_config"])["interface_v1"] == 1


def test_every_refused_flag_is_one_sglang_knows(
    tmp_path: Path, plugin_entry_point: str, tiny_model: Path
) -> None:
    options = parse(
        tmp_path, plugin_entry_point, _launch(tiny_model, types_pb2.ROLE_UNIFIED, SglangSection())
    )["options"]
    unknown = [
        f
        for f in OWNED_FLAGS
        if f not in ONLY_IN_SOME and not any(o == f or o.startswith(f) for o in options)
    ]
    assert not unknown, f"flags refused in sglang.extra_args that this SGLang does not have: {unknown}"
    # Why prefixes are refused too: SGLang's parser expands them.
    assert any(o.startswith("--disaggregation-m") for o in options)
