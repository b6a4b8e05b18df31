"""The peer id of an SGLang P/D peer is the hosting service's `peer.peer_id`: the SGLang process (here the
stand-in, which reads it with the plugin's own `XavierSettings`) registers under it, so a restarted
service (after SIGTERM, or after kill -9 while its old registration is still leased) comes back under
the same id with a higher epoch, and a bad id stops the service at start naming the key.
"""

from __future__ import annotations

import signal
from pathlib import Path

import grpc
import pytest
from xavier.v1 import directory_service_pb2 as dirpb
from xavier.v1 import directory_service_pb2_grpc as dir_grpc
from xavier.v1 import types_pb2

from tests.sglang_host.conftest import Start, ready_info, standin_state
from tests.support.procs import ServiceProc

pytestmark = pytest.mark.integration


def _peers(directory: ServiceProc, peer_id: str) -> list[dirpb.Peer]:
    with grpc.insecure_channel(directory.address) as ch:
        peers = dir_grpc.DirectoryServiceStub(ch).ListPeers(dirpb.ListPeersRequest(), timeout=5).peers
    return [p for p in peers if p.peer_id == peer_id]


def test_a_restarted_sglang_peer_keeps_its_id_with_a_higher_epoch(
    start_sglang_peer: Start, directory: ServiceProc, tmp_path: Path
) -> None:
    env = {"XAVIER_PEER__PEER_ID": "gpu-a-prefill-0"}
    first = start_sglang_peer("prefill", name="p1", env=env)
    assert standin_state(ready_info(first, tmp_path)["sglang_url"])["env"]["XAVIER_SGLANG_PEER_ID"] == (
        "gpu-a-prefill-0"
    )
    [reg1] = _peers(directory, "gpu-a-prefill-0")
    assert reg1.role == types_pb2.ROLE_PREFILL and reg1.address == first.address
    assert first.stop(signal.SIGTERM, timeout=20) == 0
    assert not _peers(directory, "gpu-a-prefill-0")  # unregistered on the way out

    second = start_sglang_peer("prefill", name="p2", env=env)
    [reg2] = _peers(directory, "gpu-a-prefill-0")
    assert reg2.epoch > reg1.epoch and reg2.address == second.address

    # kill -9: nothing unregisters, the old epoch is still leased when the restart registers; the new
    # registration ends it (one peer under the id, the newer epoch).
    second.proc.kill()
    second.proc.wait(10)
    assert [p.epoch for p in _peers(directory, "gpu-a-prefill-0")] == [reg2.epoch]
    third = start_sglang_peer("prefill", name="p3", env=env)
    [reg3] = _peers(directory, "gpu-a-prefill-0")
    assert reg3.epoch > reg2.epoch and reg3.address == third.address


def test_without_a_configured_id_the_service_default_is_registered(
    start_sglang_peer: Start, directory: ServiceProc, tmp_path: Path
) -> None:
    decode = start_sglang_peer("decode")
    peer_id = ready_info(decode, tmp_path)["peer_id"]
    assert peer_id.startswith("decode-")
    [reg] = _peers(directory, peer_id)
    assert reg.role == types_pb2.ROLE_DECODE and reg.address == decode.address


def test_a_bad_peer_id_exits_2_naming_the_key(start_sglang_peer: Start) -> None:
    with pytest.raises(RuntimeError) as info:
        start_sglang_peer("prefill", env={"XAVIER_PEER__PEER_ID": "no spaces"}, timeout=30)
    assert "exited with 2" in str(info.value) and "config error: peer.peer_id" in str(info.value)
    assert "XAVIER_SGLANG_PEER_ID" in str(info.value)
