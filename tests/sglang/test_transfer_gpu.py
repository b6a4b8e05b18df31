"""The SGLang pair protocol with both KV pools on GPU 0 (two processes, SGLang's own sender / receiver API,
as `test_transfer`): the prefill writes each chunk into the decode's pool through CUDA IPC (one fused copy,
then the chunk's notification over NIXL), or over NIXL WRITEs of VRAM with `XAVIER_SGLANG_CUDA_IPC=0`.
Checked: bytes arrive bitwise in one chunk and in several, the prefill took the path asked for, and a
decode that restarts (a new epoch, a new pool) is mapped again and written correctly, also after the
directory declared its old epoch gone.

    XAVIER_TEST_GPUS=0 python -m pytest tests/sglang/test_transfer_gpu.py -o timeout=600
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip(
    "sglang.srt.disaggregation.common.conn", reason="the real sglang package is not installed"
)

from tests.sglang.test_transfer import (  # noqa: E402
    SUCCESS,
    TRANSFERRING,
    Peer,
    assert_idle,
    peer_pair,
    scattered_room,
)
from tests.support.procs import ServiceProc  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.sglang,
    pytest.mark.integration,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

GPU = {"XAVIER_TEST_KV_DEVICE": "cuda", "XAVIER_SGLANG_NIXL_PROGRESS_THREAD": "1"}


@pytest.fixture(scope="module")
def ipc_pair(
    directory: ServiceProc, tiny_model: Path, plugin_entry_point: str
) -> Iterator[tuple[Peer, Peer]]:
    yield from peer_pair(directory, tiny_model, GPU)


def _transfer(prefill: Peer, decode: Peer, chunks: list[int]) -> None:
    got_p, got_d = scattered_room(prefill, decode, chunks)
    assert got_p["states"][-1] == SUCCESS
    assert got_d["states"][-2:] == [TRANSFERRING, SUCCESS]


@pytest.mark.parametrize("chunks", [[9], [4, 3, 2]], ids=["one-chunk", "chunked-prefill"])
def test_chunks_go_through_cuda_ipc_bitwise(ipc_pair: tuple[Peer, Peer], chunks: list[int]) -> None:
    prefill, decode = ipc_pair
    before = prefill.call("stats")
    _transfer(prefill, decode, chunks)
    after = prefill.call("stats")
    assert after["ipc_writes"] - before["ipc_writes"] == len(chunks)
    assert after["nixl_writes"] == before["nixl_writes"]
    assert_idle(prefill, decode)


def test_nixl_writes_of_vram_when_cuda_ipc_is_off(
    directory: ServiceProc, tiny_model: Path, plugin_entry_point: str
) -> None:
    for prefill, decode in peer_pair(directory, tiny_model, {**GPU, "XAVIER_SGLANG_CUDA_IPC": "0"}):
        _transfer(prefill, decode, [4, 3, 2])
        st = prefill.call("stats")
        assert st["nixl_writes"] == 3 and st["ipc_writes"] == 0
        assert_idle(prefill, decode)


def test_a_restarted_decode_is_mapped_again(
    directory: ServiceProc, tiny_model: Path, plugin_entry_point: str
) -> None:
    for prefill, decode in peer_pair(directory, tiny_model, GPU):
        _transfer(prefill, decode, [9])
        decode.kill()
        decode = Peer("decode", directory.address, tiny_model, seed=None, env=GPU)
        try:
            _transfer(prefill, decode, [9])
            # The old epoch's lease (3 s) runs out and the prefill's watch drops it: the new mapping stays.
            time.sleep(5)
            _transfer(prefill, decode, [4, 5])
            st = prefill.call("stats")
            assert st["ipc_writes"] == 4 and st["nixl_writes"] == 0
            assert_idle(prefill, decode)
        finally:
            decode.close()
