"""An SGLang-shaped peer in a child process: a real `KVArgs` over DRAM buffers (or GPU ones, with
`XAVIER_TEST_KV_DEVICE=cuda` in its environment), Xavier's manager built the way
SGLang builds it (`get_kv_class(TransferBackend(...), KVClassType.MANAGER)` after the plugin's hooks), and
requests driven through the sender / receiver API in SGLang's own order, polling as its scheduler does.

The parent talks to it over a multiprocessing pipe (never stdout: NIXL logs there). Pages hold random
bytes from a seed on the prefill and zeros on the decode; results carry per-page digests so the parent
compares bytes without moving them.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from types import SimpleNamespace
from typing import Any

import numpy as np

LAYERS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 2, 2, 16, 4
BPP = PAGE_SIZE * KV_HEADS * HEAD_DIM * 4  # float32 pages
PAGES = 64
AUX_ITEMS = (64, 128, 32)  # bytes per slot of each aux buffer (first token, logprobs, ...)
AUX_SLOTS = 8
DEADLINE_S = 60.0


ENV_KV_DEVICE = "XAVIER_TEST_KV_DEVICE"


@dataclass
class Pools:
    kv: list[Any]  # numpy arrays (DRAM) or torch CUDA uint8 tensors
    aux: list[np.ndarray]


def kv_device() -> str:
    """Where this peer's KV pool lives: "cpu" (numpy, the default) or "cuda" (GPU 0)."""
    return os.environ.get(ENV_KV_DEVICE) or "cpu"


def make_pools(seed: int | None, bpp: int = BPP) -> Pools:
    rng = np.random.default_rng(seed)

    def fill(n: int) -> np.ndarray:
        return rng.integers(0, 256, n, dtype=np.uint8) if seed is not None else np.zeros(n, np.uint8)

    kv: list[Any] = [fill(PAGES * bpp) for _ in range(2 * LAYERS)]
    if kv_device() == "cuda":
        import torch

        kv = [torch.from_numpy(a).to("cuda:0") for a in kv]
    return Pools(kv=kv, aux=[fill(AUX_SLOTS * item) for item in AUX_ITEMS])


def _addr(a: Any) -> int:
    return int(a.data_ptr()) if hasattr(a, "data_ptr") else int(a.ctypes.data)


def kv_args(pools: Pools, bpp: int = BPP, **extra: Any) -> Any:
    """SGLang's own `KVArgs`, filled as its prefill/decode bootstrap queues fill it."""
    from sglang.srt.disaggregation.base.conn import KVArgs

    args = KVArgs()
    args.engine_rank = 0
    args.kv_data_ptrs = [_addr(a) for a in pools.kv]
    args.kv_data_lens = [a.nbytes for a in pools.kv]
    args.kv_item_lens = [bpp] * len(pools.kv)
    args.kv_layer_ids = list(range(LAYERS)) * 2
    args.kv_cache_dtype_str = "auto"
    args.aux_data_ptrs = [a.ctypes.data for a in pools.aux]
    args.aux_data_lens = [a.nbytes for a in pools.aux]
    args.aux_item_lens = list(AUX_ITEMS)
    args.state_types, args.state_data_ptrs, args.state_data_lens, args.state_item_lens = [], [], [], []
    args.gpu_id = 0
    args.kv_head_num = KV_HEADS
    args.total_kv_head_num = KV_HEADS
    args.page_size = PAGE_SIZE
    args.system_dp_rank = 0
    args.pp_rank = 0
    args.prefill_start_layer = 0
    args.ib_device = None
    for k, v in extra.items():
        setattr(args, k, v)
    return args


def server_args(model: str, port: int, **extra: Any) -> Any:
    """The `ServerArgs` fields a transfer backend reads (the real class validates a whole launch)."""
    base = dict(
        model_path=model,
        served_model_name="tiny",
        tp_size=1,
        pp_size=1,
        dp_size=1,
        host="127.0.0.1",
        disaggregation_bootstrap_port=port,
        device=kv_device(),
    )
    base.update(extra)
    return SimpleNamespace(**base)


def apply_plugin() -> None:
    """Loads plugins the way SGLang's processes do; the entry point must be discoverable (see conftest)."""
    from sglang.srt.plugins import load_plugins

    load_plugins()


def kv_classes() -> dict[str, Any]:
    from sglang.srt.disaggregation import utils

    backend = utils.TransferBackend("xavier")
    return {t.value: utils.get_kv_class(backend, t) for t in utils.KVClassType}


def page_digests(arrays: Sequence[Any], pages: Sequence[int], item: Sequence[int] | int) -> list[str]:
    items = [item] * len(arrays) if isinstance(item, int) else list(item)
    arrays = [a.cpu().numpy() if hasattr(a, "cpu") else a for a in arrays]
    out = []
    for p in pages:
        h = hashlib.sha256()
        for a, n in zip(arrays, items, strict=True):
            h.update(a[p * n : (p + 1) * n].tobytes())
        out.append(h.hexdigest())
    return out


def _record(states: list[int], state: int) -> None:
    if not states or states[-1] != state:
        states.append(int(state))


def _poll_until(obj: Any, states: list[int], done: set[int], deadline: float) -> int:
    while True:
        state = int(obj.poll())
        _record(states, state)
        if state == 0:  # KVPoll.Failed: SGLang frees the room's pages now (invariant I1)
            _check_nothing_in_flight(obj)
        if state in done or time.monotonic() > deadline:
            return state
        time.sleep(0.002)


def _check_nothing_in_flight(obj: Any) -> None:
    """Failed is what makes SGLang hand a room's pages to another request: by then no transfer of the
    room may still read or write them."""
    room = obj.room
    if hasattr(room, "in_flight") and room.in_flight():
        raise AssertionError(f"room {room.room_id}: Failed while a WRITE of it is in flight")
    if hasattr(room, "release_safe") and not room.release_safe():
        raise AssertionError(f"room {room.room_id}: Failed while the prefill may still write its pages")


def _hold(cmd: dict[str, Any], sender: Any, states: list[int], deadline: float) -> None:
    """Waits, polling like SGLang's scheduler, until the parent creates `hold_file` (or the room fails)."""
    path = cmd.get("hold_file")
    while path and not os.path.exists(path) and time.monotonic() < deadline:
        if int(sender.poll()) == 0:
            return
        time.sleep(0.002)


def serve(mgr: Any, classes: dict[str, Any], pools: Pools, cmd: dict[str, Any]) -> dict[str, Any]:
    """The prefill side of one request, in the order SGLang's prefill calls it."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    room, pages, aux_slot = cmd["room"], cmd["pages"], cmd["aux_slot"]
    sender_cls = classes["sender"]
    kwargs: dict[str, Any] = dict(mgr=mgr, bootstrap_addr=cmd["addr"], bootstrap_room=room)
    if "dest_tp_ranks" in inspect.signature(sender_cls.__init__).parameters:
        kwargs.update(dest_tp_ranks=[0], pp_rank=0)
    sender = sender_cls(**kwargs)
    states: list[int] = []
    deadline = time.monotonic() + cmd.get("timeout", DEADLINE_S)
    state = _poll_until(sender, states, {KVPoll.WaitingForInput, KVPoll.Failed}, deadline)
    failure = ""
    if state == KVPoll.WaitingForInput:
        sender.init(len(pages), aux_slot)
        _hold(cmd, sender, states, deadline)
        at = 0
        for n in cmd["chunks"]:
            sender.send(np.asarray(pages[at : at + n], dtype=np.int32))
            at += n
            if at == len(pages) and cmd.get("extra_send"):
                # SGLang allows a zero-page last chunk; one past the last is a bug. Sent before the room is
                # polled again: a room already seen to succeed is never sent to by SGLang.
                sender.send(np.asarray(pages[:1], dtype=np.int32))
            _record(states, int(sender.poll()))
        if cmd.get("abort_after_send"):
            sender.abort()
        state = _poll_until(sender, states, {KVPoll.Success, KVPoll.Failed}, deadline)
    if state == KVPoll.Failed:
        try:
            sender.failure_exception()
        except Exception as exc:
            failure = f"{type(exc).__name__}|{getattr(exc, 'xavier_reason', '')}|{exc}"
    sender.clear()
    return {
        "states": states,
        "failure": failure,
        "kv": page_digests(pools.kv, pages, BPP),
        "aux": page_digests(pools.aux, [aux_slot], AUX_ITEMS),
    }


def fetch(mgr: Any, classes: dict[str, Any], pools: Pools, cmd: dict[str, Any]) -> dict[str, Any]:
    """The decode side of one request, in the order SGLang's decode calls it."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    addr, room, pages, aux_slot = cmd["addr"], cmd["room"], cmd["pages"], cmd["aux_slot"]
    abort_at = cmd.get("abort_at")
    deadline = time.monotonic() + cmd.get("timeout", DEADLINE_S)
    while not mgr.try_ensure_parallel_info(addr):
        if time.monotonic() > deadline:
            return {"states": [], "failure": "prefill never found", "kv": [], "aux": []}
        time.sleep(0.02)
    recv = classes["receiver"](mgr=mgr, bootstrap_addr=addr, bootstrap_room=room)
    states: list[int] = []
    _record(states, int(recv.poll()))
    recv.init(0)
    _record(states, int(recv.poll()))
    recv.send_metadata(np.asarray(pages, dtype=np.int32), aux_slot)
    if abort_at == "waiting":
        recv.abort()
    if abort_at == "hang":
        time.sleep(3600)  # joined the room, never reads: the parent kills this process
    done = {KVPoll.Success, KVPoll.Failed}
    if abort_at == "transferring":
        done.add(KVPoll.Transferring)
    state = _poll_until(recv, states, done, deadline)
    if abort_at == "transferring" and state == KVPoll.Transferring:
        recv.abort()
        state = _poll_until(recv, states, {KVPoll.Success, KVPoll.Failed}, deadline)
    failure = ""
    if state == KVPoll.Failed:
        try:
            recv.failure_exception()
        except Exception as exc:
            failure = f"{type(exc).__name__}|{getattr(exc, 'xavier_reason', '')}|{exc}"
    ended_at = time.time()
    safe = recv.is_abort_release_safe() if hasattr(recv, "is_abort_release_safe") else True
    recv.clear()
    return {
        "states": states,
        "failure": failure,
        "release_safe": safe,
        "ended_at": ended_at,
        "kv": page_digests(pools.kv, pages, BPP),
        "aux": page_digests(pools.aux, [aux_slot], AUX_ITEMS),
    }


def stats(mgr: Any) -> dict[str, Any]:
    hub = mgr.hub
    return {**hub.stats(), "peer": list(hub.peer), "fingerprint": hub.fingerprint}


def peer_main(
    role: str, conn: Connection, env: dict[str, str], model: str, port: int, seed: int | None
) -> None:
    """Child entry: builds the manager and answers commands until "close"."""
    os.environ.update(env)
    try:
        apply_plugin()
        from sglang.srt.disaggregation.utils import DisaggregationMode

        classes = kv_classes()
        pools = make_pools(seed)
        mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
        mgr = classes["manager"](kv_args(pools), mode, server_args(model, port), False)
        conn.send({"ok": True, "classes": {k: getattr(v, "__name__", None) for k, v in classes.items()}})
    except Exception:
        conn.send({"ok": False, "error": traceback.format_exc()})
        return
    while True:
        cmd = conn.recv()
        try:
            if cmd["op"] == "close":
                mgr.hub.close()
                conn.send({"ok": True})
                return
            handler = {"serve": serve, "fetch": fetch}.get(cmd["op"])
            if handler is not None:
                conn.send({"ok": True, **handler(mgr, classes, pools, cmd)})
            elif cmd["op"] == "stats":
                conn.send({"ok": True, **stats(mgr)})
            elif cmd["op"] == "fill_kv":
                for a in pools.kv:
                    for page in cmd["pages"]:
                        a[page * BPP : (page + 1) * BPP] = cmd["value"]
                conn.send({"ok": True})
            elif cmd["op"] == "fill_aux":
                slot, value = cmd["slot"], cmd["value"]
                for a, n in zip(pools.aux, AUX_ITEMS, strict=True):
                    a[slot * n : (slot + 1) * n] = value
                conn.send({"ok": True})
        except Exception:
            conn.send({"ok": False, "error": traceback.format_exc()})
