"""Two SGLang-shaped processes move KV and aux bytes over real NIXL (DRAM), driven only through SGLang's
sender / receiver API with SGLang's own `KVArgs`, `KVPoll` and `get_kv_class`; a real directory serves
only who is who (no room of these pairs goes through it).

Checked: bytes arrive bitwise (pages in several chunks, scattered page ids, an aux slot of three aux
buffers); `KVPoll` walks Bootstrapping → WaitingForInput → Transferring → Success on both sides; every
poll that says Failed finds nothing of the room in flight (the harness checks it: that is when SGLang
frees the pages); an aborted decode stays Transferring until its prefill confirms nothing more will be
written; a stopped directory does not stop a transfer; an abort, a bad chunk and a kill -9 of either side
end the room with its Xavier reason and leave nothing live or parked in the survivors.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "sglang.srt.disaggregation.common.conn", reason="the real sglang package is not installed"
)

from tests.sglang.peer import AUX_SLOTS, PAGES, peer_main
from tests.support.procs import ServiceProc

pytestmark = [pytest.mark.sglang, pytest.mark.integration]

BOOTING, WAITING, TRANSFERRING, SUCCESS, FAILED = 1, 2, 3, 4, 0
_ports = iter(range(19_000, 19_999))


class Peer:
    """One child process running `peer.peer_main`."""

    def __init__(
        self,
        role: str,
        directory: str,
        model: Path,
        seed: int | None,
        port: int | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.port = next(_ports) if port is None else port
        self.addr = f"127.0.0.1:{self.port}"
        env = {
            "XAVIER_DIRECTORY": directory,
            "SGLANG_PLUGINS": "xavier",
            # A 2-core CI box: NIXL's progress thread spins a core, so the polls drive NIXL instead.
            "XAVIER_SGLANG_NIXL_PROGRESS_THREAD": "0",
            **(env or {}),
        }
        self.proc = ctx.Process(
            target=peer_main, args=(role, child, env, str(model), self.port, seed), name=f"sgl-{role}"
        )
        self.proc.start()
        child.close()
        self.ready = self.result(180)

    def send(self, op: str, **kw: Any) -> None:
        self.conn.send({"op": op, **kw})

    def result(self, timeout: float = 120) -> dict[str, Any]:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.proc.name}: no answer in {timeout}s")
        got: dict[str, Any] = self.conn.recv()
        if not got["ok"]:
            raise AssertionError(f"{self.proc.name} failed:\n{got['error']}")
        return got

    def call(self, op: str, timeout: float = 120, **kw: Any) -> dict[str, Any]:
        self.send(op, **kw)
        return self.result(timeout)

    def kill(self) -> None:
        if self.proc.pid is not None and self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("close", timeout=30)
            except (TimeoutError, EOFError, BrokenPipeError, AssertionError):
                pass
        self.proc.join(15)
        if self.proc.is_alive():
            self.kill()


def peer_pair(
    directory: ServiceProc, model: Path, env: dict[str, str] | None = None
) -> Iterator[tuple[Peer, Peer]]:
    """A prefill (random pages) and a decode (zeros), closed when the generator is."""
    prefill = Peer("prefill", directory.address, model, seed=7, env=env)
    try:
        decode = Peer("decode", directory.address, model, seed=None, env=env)
    except BaseException:
        prefill.close()
        raise
    yield prefill, decode
    decode.close()
    prefill.close()


@pytest.fixture(scope="module")
def pair(directory: ServiceProc, tiny_model: Path, plugin_entry_point: str) -> Iterator[tuple[Peer, Peer]]:
    yield from peer_pair(directory, tiny_model)


def new_room() -> int:
    return random.getrandbits(62) | 1


def assert_idle(*peers: Peer) -> None:
    """Nothing of any room is left: no live room, parked room, JOIN waiting or live transfer."""
    deadline = time.monotonic() + 10
    for peer in peers:
        while True:
            st = peer.call("stats")
            idle = (
                st["rooms"] == 0
                and st["parked"] == 0
                and st["pending_joins"] == 0
                and st["live_transfers"] == 0
            )
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert idle, f"{peer.proc.name} still holds room state: {st}"


def scattered_room(prefill: Peer, decode: Peer, chunks: list[int]) -> tuple[dict[str, Any], dict[str, Any]]:
    """One room of nine scattered pages sent in `chunks`, with an aux slot; checks that it succeeded on
    both sides with every byte equal and returns the two sides' results."""
    room = new_room()
    src_pages = [3, 4, 5, 10, 11, 20, 40, 41, 63]
    dst_pages = [60, 1, 2, 7, 8, 9, 30, 31, 0]
    decode.call("fill_aux", slot=5, value=0)
    prefill.send("serve", room=room, addr=prefill.addr, pages=src_pages, chunks=chunks, aux_slot=2)
    decode.send("fetch", room=room, addr=prefill.addr, pages=dst_pages, aux_slot=5)
    got_p, got_d = prefill.result(), decode.result()
    assert got_d["failure"] == "" and got_p["failure"] == ""
    assert got_d["kv"] == got_p["kv"], "KV pages differ"
    assert got_d["aux"] == got_p["aux"], "aux slot differs"
    return got_p, got_d


def assert_in_order(states: list[int]) -> None:
    """`states` is an in-order selection of a room's life that ends in Success."""
    life = [BOOTING, WAITING, TRANSFERRING, SUCCESS]
    assert states and states[-1] == SUCCESS, states
    assert all(s in life for s in states), states
    assert [life.index(s) for s in states] == sorted({life.index(s) for s in states}), states


def test_manager_registers_one_contract(pair: tuple[Peer, Peer]) -> None:
    prefill, decode = pair
    assert prefill.ready["classes"]["manager"] == "XavierKVManager"
    assert prefill.ready["classes"]["kvargs"] == "KVArgs"
    p, d = prefill.call("stats"), decode.call("stats")
    assert p["fingerprint"] == d["fingerprint"] and len(p["fingerprint"]) == 64
    assert p["peer"][0] != d["peer"][0] and p["peer"][1] >= 1


@pytest.mark.parametrize("chunks", [[9], [4, 3, 2]], ids=["one-chunk", "chunked-prefill"])
def test_kv_and_aux_arrive_bitwise(pair: tuple[Peer, Peer], chunks: list[int]) -> None:
    prefill, decode = pair
    got_p, got_d = scattered_room(prefill, decode, chunks)
    # A poll sees the states the room passed through since the one before it, so a fast step (the
    # bootstrap before the first poll, a WRITE done before the next) is skipped: each side reports the
    # states in order, never one twice, and ends in Success.
    assert_in_order(got_p["states"])
    assert_in_order(got_d["states"])
    assert_idle(prefill, decode)


def test_bytes_arrive_with_nixls_progress_thread(
    directory: ServiceProc, tiny_model: Path, plugin_entry_point: str
) -> None:
    """The GPU default: NIXL's progress thread moves the bytes, SGLang's polls only read states."""
    on = {"XAVIER_SGLANG_NIXL_PROGRESS_THREAD": "1"}
    prefill = Peer("prefill", directory.address, tiny_model, seed=11, env=on)
    decode = Peer("decode", directory.address, tiny_model, seed=None, env=on)
    try:
        room = new_room()
        src, dst = [2, 3, 4, 30, 31], [9, 8, 7, 6, 5]
        prefill.send("serve", room=room, addr=prefill.addr, pages=src, chunks=[2, 3], aux_slot=1)
        got_d = decode.call("fetch", room=room, addr=prefill.addr, pages=dst, aux_slot=2)
        got_p = prefill.result()
        assert got_d["failure"] == "" and got_p["failure"] == ""
        assert got_d["kv"] == got_p["kv"] and got_d["aux"] == got_p["aux"]
        assert_idle(prefill, decode)
    finally:
        decode.close()
        prefill.close()


def test_decode_abort_before_the_prefill_request_waits_for_the_prefills_word(
    pair: tuple[Peer, Peer], tmp_path: Path
) -> None:
    """The decode joins and gives up before the prefill's request exists. Its pages are not free until
    the prefill says nothing will be written: while the prefill process is stopped the decode stays
    Transferring, and Failed comes only after the prefill runs again. The prefill's request for the
    room, when it comes, fails at once."""
    prefill, decode = pair
    room = new_room()
    assert prefill.proc.pid is not None
    os.kill(prefill.proc.pid, signal.SIGSTOP)
    try:
        decode.send("fetch", room=room, addr=prefill.addr, pages=[1, 2], aux_slot=1, abort_at="waiting")
        assert not decode.conn.poll(1.0), "the decode ended the room while its prefill could not answer"
    finally:
        resumed = time.time()
        os.kill(prefill.proc.pid, signal.SIGCONT)
    got_d = decode.result()
    assert got_d["states"] == [BOOTING, WAITING, TRANSFERRING, FAILED] and got_d["release_safe"]
    assert got_d["ended_at"] >= resumed
    assert "|ROOM_END_CAUSE_DECODE_FAILED|" in got_d["failure"]
    got_p = prefill.call(
        "serve", room=room, addr=prefill.addr, pages=[5, 6], chunks=[2], aux_slot=1, timeout=20
    )
    assert got_p["states"] == [FAILED]  # at its first poll
    assert "|ROOM_END_CAUSE_DECODE_FAILED|" in got_p["failure"], got_p["failure"]
    assert_idle(prefill, decode)


def test_decode_abort_mid_transfer_writes_nothing(pair: tuple[Peer, Peer], tmp_path: Path) -> None:
    """The decode gives up while the prefill computes (its sender is WaitingForInput): the prefill sees
    the CANCEL before its WRITE, writes nothing, and only then lets the decode free its pages. The
    prefill holds its WRITE until its room fails (the hold file is never made), so no timing decides."""
    prefill, decode = pair
    room = new_room()
    hold = tmp_path / "never"
    pages = list(range(PAGES // 2))
    decode.call("fill_kv", pages=pages[::-1], value=0)
    prefill.send(
        "serve",
        room=room,
        addr=prefill.addr,
        pages=pages,
        chunks=[len(pages)],
        aux_slot=3,
        hold_file=str(hold),
    )
    decode.send(
        "fetch",
        room=room,
        addr=prefill.addr,
        pages=pages[::-1],
        aux_slot=AUX_SLOTS - 1,
        abort_at="transferring",
    )
    got_p, got_d = prefill.result(), decode.result()
    assert got_d["states"] == [BOOTING, WAITING, TRANSFERRING, FAILED] and got_d["release_safe"]
    assert "|ROOM_END_CAUSE_DECODE_FAILED|" in got_d["failure"]
    assert got_p["states"][-1] == FAILED and "|ROOM_END_CAUSE_DECODE_FAILED|" in got_p["failure"], got_p
    assert len(set(got_d["kv"])) == 1, "a cancelled room's pages were written"
    assert_idle(prefill, decode)


def test_prefill_abort_after_its_write_tells_the_decode(pair: tuple[Peer, Peer]) -> None:
    prefill, decode = pair
    room = new_room()
    prefill.send(
        "serve", room=room, addr=prefill.addr, pages=[7, 8, 9], chunks=[3], aux_slot=2, abort_after_send=True
    )
    got_d = decode.call("fetch", room=room, addr=prefill.addr, pages=[10, 11, 12], aux_slot=4)
    got_p = prefill.result()
    # The abort comes after the WRITE was posted. The prefill stays Transferring until the WRITE ends and
    # then fails (or succeeded, if it saw the WRITE end first). The WRITE's own notification can reach
    # the decode before the prefill's word that it failed: the decode then has every byte and succeeds,
    # whichever way the prefill ended. Otherwise the decode fails, told why, with its pages free.
    if got_d["states"][-1] == SUCCESS:
        assert got_d["kv"] == got_p["kv"] and got_d["aux"] == got_p["aux"]
    else:
        assert got_p["states"][-1] == FAILED, got_p
        assert got_d["states"][-1] == FAILED and got_d["release_safe"]
        assert "|ROOM_END_CAUSE_PREFILL_FAILED|" in got_d["failure"], got_d["failure"]
    assert_idle(prefill, decode)


def test_send_after_the_last_chunk_fails_the_room_not_the_scheduler(pair: tuple[Peer, Peer]) -> None:
    prefill, decode = pair
    room = new_room()
    prefill.send("serve", room=room, addr=prefill.addr, pages=[1, 2], chunks=[2], aux_slot=0, extra_send=True)
    got_d = decode.call("fetch", room=room, addr=prefill.addr, pages=[3, 4], aux_slot=0)
    got_p = prefill.result()
    assert got_p["states"][-1] == FAILED and "|FAILED_PRECONDITION|" in got_p["failure"], got_p["failure"]
    # The decode got every page before the stray chunk: its room may end either way, never stuck.
    assert got_d["states"][-1] in (SUCCESS, FAILED) and got_d["release_safe"]
    assert_idle(prefill, decode)


def test_a_stopped_directory_does_not_stop_a_transfer(
    pair: tuple[Peer, Peer], directory: ServiceProc
) -> None:
    """Peers met through the directory once; after that a room needs nothing of it."""
    prefill, decode = pair
    room = new_room()
    assert directory.proc.pid is not None
    os.kill(directory.proc.pid, signal.SIGSTOP)
    try:
        prefill.send("serve", room=room, addr=prefill.addr, pages=[12, 13, 14], chunks=[1, 2], aux_slot=6)
        got_d = decode.call("fetch", room=room, addr=prefill.addr, pages=[20, 21, 22], aux_slot=6)
        got_p = prefill.result()
    finally:
        os.kill(directory.proc.pid, signal.SIGCONT)
    assert got_d["failure"] == "" and got_p["failure"] == "", (got_d["failure"], got_p["failure"])
    assert got_d["kv"] == got_p["kv"] and got_d["aux"] == got_p["aux"]
    assert_idle(prefill, decode)


def test_pages_outside_the_pool_fail_the_room_not_the_scheduler(pair: tuple[Peer, Peer]) -> None:
    prefill, decode = pair
    room = new_room()
    prefill.send("serve", room=room, addr=prefill.addr, pages=[1, PAGES], chunks=[2], aux_slot=0)
    decode.send("fetch", room=room, addr=prefill.addr, pages=[1, 2], aux_slot=0)
    got_p, got_d = prefill.result(), decode.result()
    assert got_p["states"][-1] == FAILED and "|INVALID_ARGUMENT|" in got_p["failure"], got_p["failure"]
    assert got_d["states"][-1] == FAILED and got_d["release_safe"]
    assert "|INVALID_ARGUMENT|" in got_d["failure"], got_d["failure"]  # the prefill's reason reaches it
    assert_idle(prefill, decode)


def test_decode_finds_a_prefill_restarted_at_the_same_address(
    pair: tuple[Peer, Peer], directory: ServiceProc, tiny_model: Path, plugin_entry_point: str
) -> None:
    """A prefill that stops and starts again at the same bootstrap address is a new directory peer. The
    decode still maps the address to the old one: the first request fails with a reason that says the
    prefill is gone, and that drops the mapping so the next request finds the new prefill."""
    _, decode = pair
    old = Peer("prefill", directory.address, tiny_model, seed=3)
    try:
        room = new_room()
        old.send("serve", room=room, addr=old.addr, pages=[1, 2], chunks=[2], aux_slot=0)
        got_d = decode.call("fetch", room=room, addr=old.addr, pages=[3, 4], aux_slot=0)
        assert old.result()["failure"] == "" and got_d["failure"] == "", got_d["failure"]
    finally:
        old.close()  # unregisters: its peer id leaves the directory
    new = Peer("prefill", directory.address, tiny_model, seed=4, port=old.port)
    try:
        got_d = decode.call("fetch", room=new_room(), addr=new.addr, pages=[3, 4], aux_slot=0, timeout=20)
        assert got_d["states"][-1] == FAILED and got_d["release_safe"]
        assert got_d["failure"].split("|")[1] in ("PEER_UNAVAILABLE", "ROOM_END_CAUSE_PEER_LOST"), got_d[
            "failure"
        ]
        room = new_room()
        new.send("serve", room=room, addr=new.addr, pages=[5, 6, 7], chunks=[3], aux_slot=1)
        got_d = decode.call("fetch", room=room, addr=new.addr, pages=[8, 9, 10], aux_slot=2)
        got_p = new.result()
        assert got_d["failure"] == "" and got_p["failure"] == "", got_d["failure"]
        assert got_d["kv"] == got_p["kv"] and got_d["aux"] == got_p["aux"]
        assert_idle(new, decode)
    finally:
        new.close()


def test_kill9_decode_fails_the_prefills_room(
    directory: ServiceProc, tiny_model: Path, plugin_entry_point: str, tmp_path: Path
) -> None:
    prefill = Peer("prefill", directory.address, tiny_model, seed=3)
    decode = Peer("decode", directory.address, tiny_model, seed=None)
    try:
        room = new_room()
        # The prefill holds its WRITE (as while it computes); the decode joins and dies.
        prefill.send(
            "serve", room=room, addr=prefill.addr, pages=[1, 2, 3], chunks=[3], aux_slot=0, timeout=40,
            hold_file=str(tmp_path / "never"),
        )  # fmt: skip
        decode.send("fetch", room=room, addr=prefill.addr, pages=[4, 5, 6], aux_slot=0, abort_at="hang")
        time.sleep(0.5)
        decode.kill()
        got_p = prefill.result(60)
        assert got_p["states"][-1] == FAILED
        assert "|ROOM_END_CAUSE_PEER_LOST|" in got_p["failure"], got_p["failure"]
        assert_idle(prefill)
    finally:
        decode.close()
        prefill.close()


def test_kill9_prefill_fails_the_decodes_room(
    directory: ServiceProc, tiny_model: Path, plugin_entry_point: str
) -> None:
    prefill = Peer("prefill", directory.address, tiny_model, seed=3)
    decode = Peer("decode", directory.address, tiny_model, seed=None)
    try:
        room = new_room()
        decode.call("stats")
        decode.send("fetch", room=room, addr=prefill.addr, pages=[4, 5, 6], aux_slot=0, timeout=40)
        time.sleep(0.5)
        prefill.kill()
        got_d = decode.result(60)
        assert got_d["states"][-1] == FAILED and got_d["release_safe"]
        assert "|ROOM_END_CAUSE_PEER_LOST|" in got_d["failure"], got_d["failure"]
        assert_idle(decode)
    finally:
        decode.close()
        prefill.close()


def test_decode_of_another_contract_is_told_why(
    pair: tuple[Peer, Peer], directory: ServiceProc, tmp_path: Path, plugin_entry_point: str
) -> None:
    from xavier_core.engine.tiny import make_tiny

    other_model = make_tiny(tmp_path / "other", "qwen2", layers=2, hidden=64, heads=4, kv_heads=2, seed=1)
    prefill, _ = pair
    stranger = Peer("decode", directory.address, other_model, seed=None)
    try:
        with pytest.raises(AssertionError, match="serves another KV contract") as err:
            stranger.call("fetch", room=new_room(), addr=prefill.addr, pages=[1], aux_slot=0, timeout=20)
        assert "weights_fingerprint" in str(err.value)
    finally:
        stranger.close()


def test_a_decode_that_reserved_another_page_count_is_refused(pair: tuple[Peer, Peer]) -> None:
    prefill, decode = pair
    room = new_room()
    prefill.send("serve", room=room, addr=prefill.addr, pages=[1, 2, 3], chunks=[3], aux_slot=0)
    got_d = decode.call("fetch", room=room, addr=prefill.addr, pages=[4, 5], aux_slot=0)
    got_p = prefill.result()
    assert got_p["states"][-1] == FAILED and "reserved 2 pages, the prompt has 3" in got_p["failure"]
    assert got_d["states"][-1] == FAILED and got_d["release_safe"]
    assert "|INVALID_ARGUMENT|" in got_d["failure"], got_d["failure"]
    assert_idle(prefill, decode)
