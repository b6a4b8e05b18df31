"""Xavier's classes against the real SGLang classes: subclassing, abstract methods, signatures, and every
set-up the backend refuses (with an error naming the SGLang option).

Runs against whichever sglang is importable: 0.5.23 from the `sglang-test` extra, or 0.5.17 with its
overlay on PYTHONPATH (docs/sglang.md). Version-specific expectations branch on `sglang.__version__`.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "sglang.srt.disaggregation.common.conn", reason="the real sglang package is not installed"
)

import sglang
from sglang.srt.disaggregation.base import conn as base
from sglang.srt.disaggregation.common import conn as common
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
from xavier_sglang import conn, hicache
from xavier_sglang.config import UnsupportedSetupError

from tests.sglang.peer import BPP, kv_args, make_pools, server_args

pytestmark = pytest.mark.sglang

OURS = {
    "manager": (conn.XavierKVManager, common.CommonKVManager, base.BaseKVManager),
    "sender": (conn.XavierKVSender, common.CommonKVSender, base.BaseKVSender),
    "receiver": (conn.XavierKVReceiver, common.CommonKVReceiver, base.BaseKVReceiver),
    "bootstrap": (conn.XavierKVBootstrapServer, common.CommonKVBootstrapServer, base.BaseKVBootstrapServer),
}
OLD = tuple(int(x) for x in sglang.__version__.split(".")[:3]) < (0, 5, 18)


@pytest.mark.parametrize("kind", sorted(OURS))
def test_subclasses_sglangs_bases(kind: str) -> None:
    ours, common_base, abc_base = OURS[kind]
    assert issubclass(ours, common_base) and issubclass(ours, abc_base)
    assert not inspect.isabstract(ours), f"abstract methods left: {ours.__abstractmethods__}"


@pytest.mark.parametrize("kind", sorted(OURS))
def test_abstract_and_called_methods_are_ours(kind: str) -> None:
    """Every abstract method of the base, and each method SGLang's scheduler calls, is implemented here
    (not inherited from the Common class, whose versions talk to SGLang's own bootstrap server)."""
    ours, _common, abc_base = OURS[kind]
    called = {
        "manager": {"try_ensure_parallel_info", "register_to_bootstrap"},
        "sender": {"init", "send", "poll", "failure_exception", "abort", "clear", "get_transfer_metric"},
        "receiver": {"init", "send_metadata", "poll", "failure_exception", "abort", "clear"},
        "bootstrap": {"run", "close", "poll"},
    }[kind]
    if not OLD and kind == "receiver":
        called |= {"is_abort_release_safe", "ensure_abort_notified"}
    if not OLD and kind == "manager":
        called |= {"is_abort_release_safe", "clear_deferred_abort_state"}
    for name in sorted(abc_base.__abstractmethods__ | called):
        assert name in ours.__dict__, f"{ours.__name__}.{name} is inherited, not implemented"


def _params(fn: Any) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("kind", sorted(OURS))
def test_signatures_match_sglang(kind: str) -> None:
    """Parameter names, kinds and defaults equal SGLang's for every method both define (this is where
    0.5.17's sender constructor and 0.5.23's `send_metadata(destination)` differ)."""
    ours, common_base, abc_base = OURS[kind]
    for name, fn in ours.__dict__.items():
        if (name.startswith("_") and name != "__init__") or not callable(fn):
            continue
        theirs = getattr(abc_base, name, None) or getattr(common_base, name, None)
        if theirs is None or not callable(theirs):
            continue
        assert _params(fn) == _params(theirs), f"{ours.__name__}.{name}"


def test_version_specific_signatures() -> None:
    sender = inspect.signature(conn.XavierKVSender.__init__).parameters
    receive = inspect.signature(conn.XavierKVReceiver.send_metadata).parameters
    assert ("dest_tp_ranks" in sender and "pp_rank" in sender) is OLD
    assert ("destination" in receive) is not OLD
    assert conn.XavierKVManager.supports_deferred_decode_kv_release is True


def test_kvpoll_values_are_sglangs() -> None:
    from xavier_core.transfer.nixl.rooms import KvPoll

    for ours in KvPoll:
        name = "".join(w.capitalize() for w in ours.name.split("_")).replace(
            "Waitingforinput", "WaitingForInput"
        )
        assert getattr(base.KVPoll, name) == ours.value


def test_hicache_backend_is_a_storage() -> None:
    assert issubclass(hicache.XavierHiCacheStorage, HiCacheStorage)
    assert not inspect.isabstract(hicache.XavierHiCacheStorage)
    for name in ("batch_exists", "batch_get_v1", "batch_set_v1", "register_mem_pool_host"):
        assert name in hicache.XavierHiCacheStorage.__dict__
        ours = _params(getattr(hicache.XavierHiCacheStorage, name))
        assert ours == _params(getattr(HiCacheStorage, name)), name


# --- refused set-ups ------------------------------------------------------------------------------------


def _manager(
    model: Path, monkeypatch: pytest.MonkeyPatch, args: Any = None, mla: bool = False, **sa: Any
) -> Any:
    monkeypatch.setenv("XAVIER_DIRECTORY", "127.0.0.1:1")  # never reached: the checks come first
    pools = make_pools(None)
    return conn.XavierKVManager(
        args or kv_args(pools), DisaggregationMode.PREFILL, server_args(str(model), 1, **sa), mla
    )


@pytest.mark.parametrize(
    ("server", "option"),
    [
        ({"tp_size": 2}, "--tp-size"),
        ({"pp_size": 2}, "--pp-size"),
        ({"dp_size": 2}, "--dp-size"),
        ({"device": "npu"}, "--device"),
    ],
)
def test_parallelism_is_refused(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, server: dict[str, Any], option: str
) -> None:
    with pytest.raises(UnsupportedSetupError) as err:
        _manager(tiny_model, monkeypatch, **server)
    assert err.value.option == option and option in str(err.value)


def test_mla_is_refused(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UnsupportedSetupError, match="MLA"):
        _manager(tiny_model, monkeypatch, mla=True)


def test_state_buffers_are_refused(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.disaggregation.base.conn import StateType

    pools = make_pools(None)
    args = kv_args(pools, state_types=[StateType.MAMBA], state_data_ptrs=[[pools.aux[0].ctypes.data]])
    with pytest.raises(UnsupportedSetupError, match="state buffers"):
        _manager(tiny_model, monkeypatch, args=args)


def test_page_size_the_contract_does_not_describe(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pools = make_pools(None)
    args = kv_args(pools, page_size=3)  # the pool was cut for 4-token pages
    with pytest.raises(UnsupportedSetupError) as err:
        _manager(tiny_model, monkeypatch, args=args)
    assert err.value.option == "--page-size"


@pytest.mark.parametrize(("dtype", "bpp"), [("mxfp8", BPP), ("float16", BPP)])
def test_dtype_the_contract_does_not_describe(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, dtype: str, bpp: int
) -> None:
    pools = make_pools(None)
    with pytest.raises(UnsupportedSetupError) as err:
        _manager(tiny_model, monkeypatch, args=kv_args(pools, bpp, kv_cache_dtype_str=dtype))
    assert err.value.option == "--kv-cache-dtype"


def test_non_mha_pool_layout_is_refused(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pools = make_pools(None)
    with pytest.raises(UnsupportedSetupError, match="layout"):
        _manager(tiny_model, monkeypatch, args=kv_args(pools, kv_layout="dsv4_flat"))


def test_missing_directory_is_refused(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pools = make_pools(None)
    monkeypatch.delenv("XAVIER_DIRECTORY", raising=False)
    with pytest.raises(UnsupportedSetupError) as err:
        conn.XavierKVManager(
            kv_args(pools), DisaggregationMode.DECODE, server_args(str(tiny_model), 1), False
        )
    assert err.value.option == "XAVIER_DIRECTORY"
