"""SGLang's KV manager for `--disaggregation-transfer-backend xavier` (one per scheduler process).

Imported only inside SGLang (through `conn`, which the plugin's `get_kv_class` hook returns). Like SGLang's
own backends it subclasses `CommonKVManager`, without running that constructor (ZMQ sockets and an HTTP
bootstrap registration, both replaced by the Xavier directory); it sets the attributes SGLang's prefill
and decode queues read, checks the set-up (`config`), and owns the `Hub`.
"""
# mypy: disable-error-code="misc"
# (SGLang ships no type information: its bases are `Any` to mypy.)

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import weakref
from typing import Any

import sglang
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVManager, KVTransferError, PrefillServerInfo
from sglang.srt.disaggregation.utils import DisaggregationMode
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2

from xavier_core.contract import differing_fields
from xavier_core.transfer.common.errors import TransferError

from .config import PoolShape, ProcessShape, XavierSettings, check_supported, contract_layout
from .hub import Hub, PairPeer
from .reader import ReaderRoom
from .rooms import RoomFailure

__all__ = ["XavierKVManager", "XavierTransferError"]


class XavierTransferError(KVTransferError):
    """SGLang's `KVTransferError` with the Xavier reason (`xavier_reason`) of the failed room."""

    def __init__(self, bootstrap_room: int, failure: RoomFailure) -> None:
        super().__init__(bootstrap_room, str(failure))
        self.xavier_reason = failure.code


class XavierKVManager(CommonKVManager):
    """One per SGLang scheduler process: checks the set-up, registers the buffers with NIXL and the
    process with the directory (role, epoch, contract fingerprint), and owns the rooms."""

    supports_deferred_decode_kv_release = True
    supports_host_destination = False
    supports_role_switch = False

    def __init__(
        self,
        args: Any,
        disaggregation_mode: DisaggregationMode,
        server_args: Any,
        is_mla_backend: bool | None = False,
    ) -> None:
        # CommonKVManager.__init__ is not called: it binds ZMQ sockets and registers with an HTTP bootstrap
        # server, both replaced by the directory. The attributes SGLang's scheduler reads are set here.
        gpu_id = int(getattr(args, "gpu_id", 0) or 0)
        proc = ProcessShape.from_server_args(server_args, bool(is_mla_backend), sglang.__version__, gpu_id)
        pool = PoolShape.from_kv_args(args, proc.kv_device)
        check_supported(proc, pool)
        layout = contract_layout(
            proc, pool, model_name=str(getattr(server_args, "served_model_name", "") or "")
        )
        settings = XavierSettings.from_env(default_advertise=f"{proc.host}:{proc.bootstrap_port}")
        if disaggregation_mode == DisaggregationMode.PREFILL:
            role = types_pb2.ROLE_PREFILL
        elif disaggregation_mode == DisaggregationMode.DECODE:
            role = types_pb2.ROLE_DECODE
        else:
            raise ValueError(f"Unsupported DisaggregationMode: {disaggregation_mode}")
        self.kv_args = args
        self.kv_cache_dtype_str = pool.dtype
        self.kv_item_lens_sum = sum(b.bytes_per_page for b in pool.kv)
        self.state_item_lens_sum = 0
        self.is_mla_backend = bool(is_mla_backend)
        self.is_hybrid_mla_backend = False
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.enable_deferred_decode_kv_release = True
        self.enable_staging = False
        self.attn_tp_size, self.attn_tp_rank, self.attn_cp_size, self.attn_cp_rank = 1, 0, 1, 0
        self.attn_dp_size, self.attn_dp_rank, self.pp_size, self.pp_rank = 1, 0, 1, 0
        self.enable_all_cp_ranks_for_transfer = False
        self.is_dummy_cp_rank = False
        self.bootstrap_host, self.bootstrap_port = proc.host, proc.bootstrap_port
        self.request_status: dict[int, int] = {}
        self.failure_records: dict[int, str] = {}
        self.transfer_infos: dict[int, Any] = {}
        self.req_to_decode_prefix_len: dict[int, int] = {}
        self.prefill_info_table: dict[str, Any] = {}
        self.bootstrap_timeout = settings.bootstrap_timeout_s
        self.waiting_timeout = settings.waiting_timeout_s
        self._prefill_peers: dict[str, PairPeer] = {}
        self._lookups: dict[str, concurrent.futures.Future[list[dpb.Peer]]] = {}
        self.readers: weakref.WeakValueDictionary[int, ReaderRoom] = weakref.WeakValueDictionary()
        self.hub = Hub(role, pool, layout, settings)
        # Unregister at exit so decodes see a stopped prefill at once, not after its lease.
        atexit.register(self.hub.close)

    # --- BaseKVManager ---------------------------------------------------------------------

    def register_to_bootstrap(self) -> None:
        """Nothing to do: the process registered with the Xavier directory when it was created."""

    def get_kv_replica_factor(self) -> int:
        return 1

    def should_verify_kv_checksum(self, bootstrap_addr: str) -> bool:
        return True

    def teardown(self) -> None:
        self.hub.close()

    # --- the decode's view of prefills ---------------------------------------------------

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Non-blocking: True once the prefill that serves `bootstrap_addr` is found in the directory
        (same role, same contract fingerprint, registered with that address). The first call starts the
        lookup; SGLang calls again at its retry interval."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        fut = self._lookups.get(bootstrap_addr)
        if fut is None:
            self._lookups[bootstrap_addr] = self.hub.submit(
                self.hub.client.list_peers(types_pb2.ROLE_PREFILL)
            )
            return False
        if not fut.done():
            return False
        del self._lookups[bootstrap_addr]
        if fut.exception() is not None:
            return False
        found = [p for p in fut.result() if p.address == bootstrap_addr]
        ours = [p for p in found if p.contract_fingerprint == self.hub.fingerprint]
        if found and not ours:
            # Like SGLang's own page-size / dtype checks here: a clear error instead of endless retries.
            fields = differing_fields(found[0].layout, self.hub.layout)
            raise RuntimeError(
                f"the prefill at {bootstrap_addr} serves another KV contract than this decode "
                f"(differing: {', '.join(fields) or 'contract_fingerprint'}); both must run the same model, "
                "dtype, page size and SGLang version"
            )
        if not ours:
            return False
        peer = max(ours, key=lambda p: p.epoch)
        try:
            self._prefill_peers[bootstrap_addr] = self.hub.load_peer(peer)
        except TransferError as exc:
            raise RuntimeError(f"the prefill at {bootstrap_addr} cannot be reached over NIXL: {exc}") from exc
        self.prefill_info_table[bootstrap_addr] = _prefill_info(
            self.kv_args.page_size, self.kv_cache_dtype_str
        )
        return True

    def prefill_peer(self, bootstrap_addr: str) -> PairPeer | None:
        return self._prefill_peers.get(bootstrap_addr)

    def forget_prefill(self, bootstrap_addr: str, prefill: PairPeer) -> None:
        """Drops `prefill`, whose epoch ended, from the address it served (unless a newer lookup replaced
        it already) and unloads its NIXL agent, so the next request looks it up again."""
        self.hub.forget_peer(prefill)
        if self._prefill_peers.get(bootstrap_addr) == prefill:
            del self._prefill_peers[bootstrap_addr]
            self.prefill_info_table.pop(bootstrap_addr, None)

    # --- 0.5.23 deferred decode KV release ------------------------------------------------

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
        """True once no WRITE of the prefill can still land in the room's pages: the prefill answered
        the decode's CANCEL (it sends FAILED only once nothing of the room is in flight), or it left
        the directory (see `reader.ReaderRoom`)."""
        reader = self.readers.get(bootstrap_room)
        return reader is None or reader.release_safe()

    def register_deferred_abort_room(self, bootstrap_room: int) -> int:
        return 0

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        """Nothing is tracked beyond the receiver itself."""

    # --- status table kept for SGLang code that reads it -----------------------------------

    def check_status(self, bootstrap_room: int) -> int:
        return self.request_status.get(bootstrap_room, int(KVPoll.Bootstrapping))

    def update_status(self, bootstrap_room: int, status: int) -> None:
        self.request_status[bootstrap_room] = status

    def record_failure(self, bootstrap_room: int, failure_reason: str) -> None:
        self.failure_records[bootstrap_room] = failure_reason


def _prefill_info(page_size: int, dtype: str) -> Any:
    """A `PrefillServerInfo` for a single-rank prefill, built from the fields this release declares."""
    values: dict[str, Any] = {
        "attn_tp_size": 1,
        "attn_cp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "page_size": page_size,
        "kv_cache_dtype": dtype,
        "follow_bootstrap_room": True,
        "target_tp_rank": 0,
        "target_tp_ranks": [0],
        "target_cp_ranks": [0],
        "target_pp_ranks": [0],
        "required_dst_info_num": 1,
        "required_prefill_response_num": 1,
    }
    names = {f.name for f in dataclasses.fields(PrefillServerInfo)}
    return PrefillServerInfo(**{k: v for k, v in values.items() if k in names})
