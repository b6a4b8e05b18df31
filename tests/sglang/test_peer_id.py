"""The plugin's peer id: `XAVIER_SGLANG_PEER_ID` (the hosting service's `peer.peer_id`) is read and checked
by `XavierSettings`, and SGLang's own KV manager, built through `get_kv_class` in a fresh process,
registers under it; a second process under the same id (a restart) gets the same id and a higher epoch.
Without it the directory assigns an id per start. A bad id fails the manager at start naming the
variable.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from xavier_sglang.config import ENV_PEER_ID, UnsupportedSetupError, XavierSettings

from tests.support.procs import ServiceProc

BASE = {"XAVIER_DIRECTORY": "127.0.0.1:7100"}


def test_settings_read_the_peer_id() -> None:
    settings = XavierSettings.from_env("10.0.0.2:7400", {**BASE, ENV_PEER_ID: "gpu-a.prefill@0:x-1"})
    assert settings.peer_id == "gpu-a.prefill@0:x-1" and settings.advertise == "10.0.0.2:7400"
    assert XavierSettings.from_env("h:1", BASE).peer_id == ""  # the directory assigns one
    assert XavierSettings.from_env("h:1", {**BASE, ENV_PEER_ID: ""}).peer_id == ""
    assert XavierSettings.from_env("h:1", {**BASE, ENV_PEER_ID: "p" * 128}).peer_id == "p" * 128


@pytest.mark.parametrize("bad", ["a b", "p" * 129, "gpu/0", "é", "x\n"])
def test_a_bad_peer_id_names_the_variable(bad: str) -> None:
    with pytest.raises(UnsupportedSetupError) as info:
        XavierSettings.from_env("h:1", {**BASE, ENV_PEER_ID: bad})
    assert info.value.option == ENV_PEER_ID and "A-Za-z0-9._:@-" in str(info.value)


@pytest.mark.sglang
@pytest.mark.integration
def test_the_manager_registers_under_the_id_and_a_restart_gets_a_higher_epoch(
    directory: ServiceProc, tiny_model: Path, plugin_entry_point: str
) -> None:
    pytest.importorskip(
        "sglang.srt.disaggregation.common.conn", reason="the real sglang package is not installed"
    )
    from tests.sglang.test_transfer import Peer

    env = {ENV_PEER_ID: "sgl-prefill-7"}
    first = Peer("prefill", directory.address, tiny_model, seed=1, env=env)
    try:
        peer_id, epoch = first.call("stats")["peer"]
        assert peer_id == "sgl-prefill-7"
    finally:
        first.kill()  # no unregistration: the restart finds the old epoch still leased
    second = Peer("prefill", directory.address, tiny_model, seed=1, port=first.port, env=env)
    try:
        peer_id2, epoch2 = second.call("stats")["peer"]
        assert peer_id2 == "sgl-prefill-7" and epoch2 > epoch
    finally:
        second.close()
    with pytest.raises(AssertionError, match=ENV_PEER_ID):
        Peer("decode", directory.address, tiny_model, seed=None, env={ENV_PEER_ID: "no spaces"})
    anonymous = Peer("decode", directory.address, tiny_model, seed=None)
    try:
        assigned, _ = anonymous.call("stats")["peer"]
        assert assigned and assigned != "sgl-prefill-7"
    finally:
        anonymous.close()
