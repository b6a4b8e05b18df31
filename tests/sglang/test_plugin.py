"""The plugin, loaded by SGLang's own `load_plugins()` in a fresh process (hooks are process-global).

A process configured for Xavier (the directory in its environment, or the xavier backend on its command
line) gets the CLI choice, `TransferBackend.XAVIER` (also in the modules that imported the enum by name
before the plugin ran, such as the prefill queue) and Xavier's classes from `get_kv_class`; other backends
still resolve as before. A process not configured for Xavier is left untouched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang.srt.plugins.hook_registry", reason="the real sglang package is not installed")

pytestmark = pytest.mark.sglang

PROBE = r"""
import argparse, json, sys
out_path, argv = sys.argv[1], sys.argv[2:]
sys.argv = ["sglang"] + argv
import sglang.srt.disaggregation.prefill as prefill  # binds TransferBackend by name before the plugin
from sglang.srt.disaggregation import utils
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
saved = {"original": utils.TransferBackend}  # not a module attribute: the registry rebinds those
load_plugins()
out = {
    "members": sorted(m.value for m in utils.TransferBackend),
    "replaced": utils.TransferBackend is not saved["original"],
    "prefill_rebound": prefill.TransferBackend is utils.TransferBackend,
    "hook_targets": sorted(t for t in HookRegistry._hooks if t.startswith("sglang.srt.disaggregation")),
    "fake_manager": utils.get_kv_class(utils.TransferBackend("fake"), utils.KVClassType.MANAGER).__name__,
}
if "xavier" in out["members"]:
    backend = utils.TransferBackend("xavier")
    out["classes"] = {
        t.value: getattr(utils.get_kv_class(backend, t), "__module__", "") + "."
        + getattr(utils.get_kv_class(backend, t), "__name__", "")
        for t in utils.KVClassType
    }
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
try:
    args = parser.parse_args(["--model-path", "m", "--disaggregation-transfer-backend", "xavier"])
    out["cli"] = args.disaggregation_transfer_backend
except SystemExit:
    out["cli"] = None
json.dump(out, open(out_path, "w"))
"""


def probe(tmp_path: Path, plugin_path: str, env: dict[str, str], argv: list[str]) -> dict[str, Any]:
    out = tmp_path / "probe.json"
    full = {k: v for k, v in os.environ.items() if k not in ("XAVIER_DIRECTORY", "SGLANG_PLUGINS")}
    if plugin_path:
        full["PYTHONPATH"] = os.pathsep.join([plugin_path, full.get("PYTHONPATH", "")])
    full.update(env)
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(out), *argv], env=full, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def test_configured_process_gets_the_backend(tmp_path: Path, plugin_entry_point: str) -> None:
    got = probe(
        tmp_path, plugin_entry_point, {"SGLANG_PLUGINS": "xavier", "XAVIER_DIRECTORY": "127.0.0.1:1"}, []
    )
    assert "xavier" in got["members"] and {"nixl", "mooncake", "fake"} <= set(got["members"])
    assert got["replaced"] and got["prefill_rebound"]
    assert got["cli"] == "xavier"
    assert got["classes"] == {
        "kvargs": "sglang.srt.disaggregation.base.conn.KVArgs",
        "manager": "xavier_sglang.manager.XavierKVManager",
        "sender": "xavier_sglang.conn.XavierKVSender",
        "receiver": "xavier_sglang.conn.XavierKVReceiver",
        "bootstrap_server": "xavier_sglang.conn.XavierKVBootstrapServer",
    }
    assert got["fake_manager"] == "FakeKVManager"  # other backends still resolve through the original


def test_command_line_alone_configures_it(tmp_path: Path, plugin_entry_point: str) -> None:
    argv = ["--model-path", "m", "--disaggregation-transfer-backend", "xavier"]
    got = probe(tmp_path, plugin_entry_point, {"SGLANG_PLUGINS": "xavier"}, argv)
    assert "xavier" in got["members"] and got["cli"] == "xavier"


def test_unconfigured_process_is_untouched(tmp_path: Path, plugin_entry_point: str) -> None:
    got = probe(tmp_path, plugin_entry_point, {}, ["--disaggregation-transfer-backend", "nixl"])
    assert "xavier" not in got["members"]
    assert not got["replaced"] and got["hook_targets"] == []
    assert got["cli"] is None  # the choice was not added: argparse refuses it


def test_plugins_not_allow_listed_are_not_loaded(tmp_path: Path, plugin_entry_point: str) -> None:
    got = probe(
        tmp_path, plugin_entry_point, {"SGLANG_PLUGINS": "other", "XAVIER_DIRECTORY": "127.0.0.1:1"}, []
    )
    assert "xavier" not in got["members"] and got["hook_targets"] == []
