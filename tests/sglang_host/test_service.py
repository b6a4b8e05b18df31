"""Services hosting SGLang, end to end with real processes: the service, its SGLang (the stand-in in
tests/support/sglang_standin.py, launched through `sglang.command`), a directory and a router.

The child's lifecycle (start, health wait, death → NOT_SERVING + unregistered + exit 1, SIGTERM and
SIGKILL of the service leave no process behind), the RPC translation (unified, P/D through the router
with prefill and decode called concurrently, cancel → SGLang aborts, SGLang's failures → statuses).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from xavier.v1 import decode_service_pb2 as dpb
from xavier.v1 import decode_service_pb2_grpc, prefill_service_pb2_grpc, types_pb2
from xavier.v1 import directory_service_pb2 as dirpb
from xavier.v1 import directory_service_pb2_grpc as dir_grpc
from xavier.v1 import prefill_service_pb2 as ppb
from xavier_client import Client, InvalidArgumentError, Mode
from xavier_services.router.pair_call import first_token_source
from xavier_sglang.features import UNIFIED_FEATURES

from tests.sglang_host.conftest import Start, ready_info, standin_state
from tests.support.procs import ServiceProc, health_status, start_service
from tests.support.sglang_standin import alternatives, next_token, token_logprob

pytestmark = pytest.mark.integration


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _wait(cond: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out: {what}")
        time.sleep(0.05)


def _proc_info(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError as exc:
        return f"{pid}: {exc}"
    return f"{pid}: {stat[:120]} / {cmd[:200]}"


def _peers(directory: ServiceProc) -> list[dirpb.Peer]:
    with grpc.insecure_channel(directory.address) as ch:
        return list(dir_grpc.DirectoryServiceStub(ch).ListPeers(dirpb.ListPeersRequest(), timeout=5).peers)


def _expected(prompt: list[int], n: int) -> list[int]:
    out = [next_token(prompt[-1])]
    while len(out) < n:
        out.append(next_token(out[-1]))
    return out


def _rpc_count(metrics: str, method: str) -> float:
    """`xavier_rpc_total` of `method` at the service whose /metrics is `metrics`, every code together."""
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5) as resp:
        lines = resp.read().decode().splitlines()
    mine = [x for x in lines if x.startswith("xavier_rpc_total{") and f'method="{method}"' in x]
    return sum(float(x.rsplit(" ", 1)[1]) for x in mine)


def _router(directory: ServiceProc, model: Path, workdir: Path) -> ServiceProc:
    args = ["--model", str(model), "--directory", directory.address, "--listen", "127.0.0.1:0", "--http", ""]
    return start_service("xavier-router", args, workdir, env={"XAVIER_PEER_REFRESH_SECONDS": "0.1"})


def test_unified_serves_generate_through_sglang(
    start_sglang_peer: Start, directory: ServiceProc, tmp_path: Path
) -> None:
    unified = start_sglang_peer("unified")
    info = ready_info(unified, tmp_path)
    state = standin_state(info["sglang_url"])
    argv = state["argv"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert "--api-key" in argv and "--disaggregation-mode" not in argv
    assert "SGLANG_PLUGINS" not in state["env"]
    with grpc.insecure_channel(unified.address) as ch:
        stub = decode_service_pb2_grpc.DecodeServiceStub(ch)
        req = dpb.GenerateUnifiedRequest(
            request_id="u1", token_ids=[5, 6, 7], sampling=types_pb2.SamplingParams(max_tokens=5)
        )
        msgs = list(stub.GenerateUnified(req, timeout=30))
        ids = [t for m in msgs for t in m.delta.token_ids]
        assert ids == _expected([5, 6, 7], 5)
        assert "".join(m.delta.text for m in msgs) == "".join(f"t{t} " for t in ids)
        assert msgs[-1].finish_reason == types_pb2.FINISH_REASON_LENGTH
        assert msgs[-1].usage.prompt_tokens == 3 and msgs[-1].usage.completion_tokens == 5
        # The wrong RPC for the role, and input SGLang would refuse: statuses with reasons.
        with pytest.raises(grpc.RpcError) as info_err:
            list(stub.Decode(dpb.DecodeRequest(room_id=1, prefill_peer_id="p", token_ids=[1]), timeout=5))
        assert info_err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError) as info_err:
            list(stub.GenerateUnified(dpb.GenerateUnifiedRequest(request_id="u2"), timeout=5))
        assert info_err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert standin_state(info["sglang_url"])["bad_key"] == 0
    # The service registered itself (a unified SGLang has no plugin registration).
    (mine,) = [p for p in _peers(directory) if p.address == unified.address]
    assert mine.layout.engine == "sglang"
    assert tuple(mine.layout.features) == UNIFIED_FEATURES  # what its `/generate` mapping honours


def test_cancel_closes_the_http_stream_and_sglang_aborts(start_sglang_peer: Start, tmp_path: Path) -> None:
    unified = start_sglang_peer("unified", env={"XAVIER_STANDIN_TOKEN_DELAY": "0.2"})
    url = ready_info(unified, tmp_path)["sglang_url"]

    async def run() -> None:
        async with grpc.aio.insecure_channel(unified.address) as ch:
            stub = decode_service_pb2_grpc.DecodeServiceStub(ch)
            call = stub.GenerateUnified(
                dpb.GenerateUnifiedRequest(
                    request_id="c1", token_ids=[1, 2], sampling=types_pb2.SamplingParams(max_tokens=100)
                )
            )
            await call.read()
            call.cancel()

    asyncio.run(run())
    _wait(lambda: standin_state(url)["aborted"] == 1, 10, "SGLang saw the request aborted")


def test_pd_through_the_router_calls_prefill_and_decode_concurrently(
    start_sglang_peer: Start, directory: ServiceProc, tiny_model: Path, tmp_path: Path
) -> None:
    prefill = start_sglang_peer("prefill")
    decode = start_sglang_peer("decode")
    start_sglang_peer("unified")
    pinfo, dinfo = ready_info(prefill, tmp_path), ready_info(decode, tmp_path)
    for info, mode in ((pinfo, "prefill"), (dinfo, "decode")):
        state = standin_state(info["sglang_url"])
        argv = state["argv"]
        assert argv[argv.index("--disaggregation-mode") + 1] == mode
        assert argv[argv.index("--disaggregation-transfer-backend") + 1] == "xavier"
        assert state["env"]["SGLANG_PLUGINS"] == "xavier"
        assert ("--disable-radix-cache" in argv) == (mode == "decode")
    # The SGLang processes registered themselves under their services' addresses, engine "sglang".
    peers = {p.address: p for p in _peers(directory)}
    assert peers[prefill.address].role == types_pb2.ROLE_PREFILL
    assert peers[decode.address].layout.engine == "sglang"
    router = _router(directory, tiny_model, tmp_path)
    try:
        prompt = [11, 12, 13]
        with Client(router.address) as client:
            for n in (1, 4, 9):
                pd = client.generate(prompt, max_tokens=n, mode="pd", ignore_eos=True)
                co = client.generate(prompt, max_tokens=n, mode="colocated", ignore_eos=True)
                assert pd.token_ids == co.token_ids == _expected(prompt, n)
                assert pd.text == co.text and pd.finish_reason == "length"
    finally:
        router.stop()
    assert standin_state(pinfo["sglang_url"])["requests"] == 3
    assert standin_state(dinfo["sglang_url"])["requests"] == 3
    # Both declare call sessions, so the router's calls went on one session each (counted once it ended).
    for peer, session in ((prefill, "PrefillSession"), (decode, "DecodeSession")):
        assert types_pb2.SERVICE_FEATURE_CALL_SESSIONS in peers[peer.address].layout.service_features
        assert _rpc_count(peer.metrics, session) == 1, session


def _logprob_answer(client: Client, prompt: list[int], mode: Mode) -> dict[str, object]:
    """A streamed answer's token ids, logprobs, alternatives and prompt logprobs (with the index of the
    response that carried them)."""
    stream = client.generate_stream(
        prompt, mode=mode, max_tokens=4, ignore_eos=True, logprobs=True, top_logprobs=3, prompt_logprobs=True
    )
    raw = [c.raw for c in stream]
    msgs = [m for m in raw if m is not None]
    carried = [i for i, m in enumerate(msgs) if m.HasField("prompt_logprobs")]
    prompt_lps = msgs[carried[0]].prompt_logprobs if carried else None
    return {
        "token_ids": [t for m in msgs for t in m.token_ids],
        "logprobs": [v for m in msgs for v in m.logprobs],
        "top": [(list(a.token_ids), list(a.logprobs)) for m in msgs for a in m.top_logprobs],
        "prompt": None if prompt_lps is None else list(prompt_lps.logprobs),
        "prompt_top": None if prompt_lps is None else [list(a.token_ids) for a in prompt_lps.top_logprobs],
        "carried": carried,
    }


def test_a_pair_answers_the_logprobs_a_unified_server_does(
    start_sglang_peer: Start, directory: ServiceProc, tiny_model: Path, tmp_path: Path
) -> None:
    """Through the router, an SGLang pair's top logprobs (every token's, from the decode) and prompt
    logprobs (from the prefill's answer, on the first response) equal a unified server's; the prefill is
    asked for the prompt's logprobs, the decode only for the alternatives."""
    prefill = start_sglang_peer("prefill")
    decode = start_sglang_peer("decode")
    start_sglang_peer("unified")
    pinfo, dinfo = ready_info(prefill, tmp_path), ready_info(decode, tmp_path)
    router = _router(directory, tiny_model, tmp_path)
    prompt = [11, 12, 13, 14]
    try:
        with Client(router.address) as client:
            pd = _logprob_answer(client, prompt, "pd")
            co = _logprob_answer(client, prompt, "colocated")
    finally:
        router.stop()
    tokens = _expected(prompt, 4)
    assert pd == co
    assert pd["token_ids"] == tokens and pd["carried"] == [0]
    assert pd["top"] == [
        ([a[1] for a in alternatives(t, 3)], [a[0] for a in alternatives(t, 3)]) for t in tokens
    ]
    assert pd["prompt"] == [token_logprob(t) - 1 for t in prompt[1:]]
    assert pd["prompt_top"] == [[a[1] for a in alternatives(t, 3)] for t in prompt[1:]]
    asked_prefill = standin_state(pinfo["sglang_url"])["last_sampling"]
    asked_decode = standin_state(dinfo["sglang_url"])["last_sampling"]
    assert asked_prefill["logprob_start_len"] == 0 and asked_prefill["top_logprobs_num"] == 3
    assert "logprob_start_len" not in asked_decode and asked_decode["top_logprobs_num"] == 3


def test_decode_errors_name_the_reason(
    start_sglang_peer: Start, directory: ServiceProc, tmp_path: Path
) -> None:
    prefill = start_sglang_peer("prefill")
    decode = start_sglang_peer("decode")
    prefill_peer = next(p for p in _peers(directory) if p.address == prefill.address)
    with grpc.insecure_channel(decode.address) as ch:
        stub = decode_service_pb2_grpc.DecodeServiceStub(ch)

        def decode_call(peer_id: str, epoch: int) -> grpc.RpcError:
            req = dpb.DecodeRequest(
                room_id=42, prefill_peer_id=peer_id, prefill_epoch=epoch, token_ids=[1, 2],
                sampling=types_pb2.SamplingParams(max_tokens=3),
            )  # fmt: skip
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Decode(req, timeout=30))
            return info.value

        err = decode_call("no-such-prefill", 1)
        assert err.code() == grpc.StatusCode.NOT_FOUND and "no-such-prefill" in (err.details() or "")
        # A room whose prefill never comes: SGLang aborts it; the decode answers ABORTED / TRANSFER_FAILED.
        err = decode_call(prefill_peer.peer_id, prefill_peer.epoch)
        assert err.code() == grpc.StatusCode.ABORTED and "never sent" in (err.details() or "")
        assert _reason(err) == "TRANSFER_FAILED"


def _reason(err: grpc.RpcError) -> str:
    from xavier_core.runtime import from_rpc_error

    return from_rpc_error(err).reason  # type: ignore[arg-type]


def test_a_dead_sglang_takes_its_service_out_of_the_mesh(
    start_sglang_peer: Start, directory: ServiceProc, tmp_path: Path
) -> None:
    prefill = start_sglang_peer("prefill")
    info = ready_info(prefill, tmp_path)
    helper = standin_state(info["sglang_url"])["helper_pid"]
    assert any(p.address == prefill.address for p in _peers(directory))
    os.kill(info["sglang_pid"], signal.SIGKILL)
    code = prefill.proc.wait(30)
    assert code == 1  # the supervisor (xavier up, systemd) restarts it
    log = prefill.log()
    assert "SGLang exited (killed by signal 9)" in log
    # Unregistered at once (the directory's lease is 3 s; this checks well before it lapses).
    assert not any(p.address == prefill.address for p in _peers(directory))
    _wait(lambda: not _alive(helper), 10, "SGLang's helper process died with it")


def test_a_slow_sglang_start_is_waited_for(start_sglang_peer: Start, tmp_path: Path) -> None:
    unified = start_sglang_peer("unified", name="slow", env={"XAVIER_STANDIN_START_DELAY": "1.5"})
    assert health_status(unified.address) == health_pb2.HealthCheckResponse.SERVING


def test_sglang_that_fails_at_start_fails_the_service(start_sglang_peer: Start) -> None:
    with pytest.raises(RuntimeError) as info:
        start_sglang_peer("unified", env={"XAVIER_STANDIN_EXIT_AT_START": "3"}, timeout=30)
    assert "SGLang did not start" in str(info.value) and "exit code 3" in str(info.value)


def test_an_owned_flag_in_extra_args_stops_the_service_at_start(start_sglang_peer: Start) -> None:
    env = {"XAVIER_SGLANG__EXTRA_ARGS": json.dumps(["--disaggregation-mode", "decode"])}
    with pytest.raises(RuntimeError) as info:
        start_sglang_peer("unified", env=env, timeout=30)
    assert "sglang.extra_args" in str(info.value) and "--disaggregation-mode" in str(info.value)


@pytest.mark.parametrize("ignore_sigterm", [False, True])
def test_sigterm_stops_sglang_and_its_processes(
    start_sglang_peer: Start, tmp_path: Path, ignore_sigterm: bool
) -> None:
    env = {"XAVIER_SGLANG__STOP_GRACE_SECONDS": "1"}
    if ignore_sigterm:
        env["XAVIER_STANDIN_IGNORE_SIGTERM"] = "1"
    unified = start_sglang_peer("unified", env=env)
    info = ready_info(unified, tmp_path)
    helper = standin_state(info["sglang_url"])["helper_pid"]
    assert unified.stop(signal.SIGTERM, timeout=20) == 0
    for pid in (info["sglang_pid"], helper):
        _wait(lambda pid=pid: not _alive(pid), 5, f"process {pid} gone")


def test_sigkill_of_the_service_leaves_no_orphan(start_sglang_peer: Start, tmp_path: Path) -> None:
    unified = start_sglang_peer("unified")
    info = ready_info(unified, tmp_path)
    helper = standin_state(info["sglang_url"])["helper_pid"]
    unified.proc.kill()
    unified.proc.wait(10)
    for pid in (info["sglang_pid"], helper):
        try:
            _wait(lambda pid=pid: not _alive(pid), 20, "")
        except AssertionError:
            raise AssertionError(f"still there after the service was killed: {_proc_info(pid)}") from None


def test_pdeathsig_wrapper_refuses_bad_usage() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "xavier_services.sglang_host.pdeathsig", str(os.getpid())],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2 and "usage" in out.stderr


def test_the_mesh_heals_when_a_prefill_sglang_dies(
    start_sglang_peer: Start, directory: ServiceProc, tiny_model: Path, tmp_path: Path
) -> None:
    a = start_sglang_peer("prefill", name="prefill-a")
    start_sglang_peer("prefill", name="prefill-b")
    start_sglang_peer("decode")
    router = _router(directory, tiny_model, tmp_path)
    try:
        with Client(router.address) as client:
            for i in range(4):
                out = client.generate([20 + i, 3], max_tokens=3, mode="pd", ignore_eos=True)
                assert out.token_ids == _expected([20 + i, 3], 3)
            os.kill(ready_info(a, tmp_path)["sglang_pid"], signal.SIGKILL)
            assert a.proc.wait(30) == 1
            for i in range(6):  # every request lands on the surviving prefill
                out = client.generate([30 + i, 4], max_tokens=3, mode="pd", ignore_eos=True)
                assert out.token_ids == _expected([30 + i, 4], 3)
    finally:
        router.stop()


def test_a_failed_prefill_ends_the_request_at_once_and_cancels_the_decode(
    start_sglang_peer: Start, directory: ServiceProc, tiny_model: Path, tmp_path: Path
) -> None:
    # The prefill fails after 1 s, once the decode's request waits in its SGLang for the room.
    start_sglang_peer(
        "prefill", env={"XAVIER_STANDIN_GENERATE_STATUS": "400", "XAVIER_STANDIN_FAIL_AFTER": "1"}
    )
    decode = start_sglang_peer("decode", env={"XAVIER_STANDIN_RENDEZVOUS_SECONDS": "30"})
    durl = ready_info(decode, tmp_path)["sglang_url"]
    router = _router(directory, tiny_model, tmp_path)
    try:
        with Client(router.address) as client:
            started = time.monotonic()
            with pytest.raises(InvalidArgumentError) as info:
                client.generate([1, 2], max_tokens=3, mode="pd")
            # The decode would wait 30 s for a room that never fills; the prefill's error ends it now.
            assert time.monotonic() - started < 10
            assert "stand-in answers 400" in str(info.value)
        _wait(lambda: standin_state(durl)["aborted"] == 1, 10, "the decode's SGLang request aborted")
        assert standin_state(durl)["requests"] == 1
    finally:
        router.stop()


def test_a_request_in_flight_when_sglang_dies_gets_a_clear_status(
    start_sglang_peer: Start, tmp_path: Path
) -> None:
    unified = start_sglang_peer("unified", env={"XAVIER_STANDIN_TOKEN_DELAY": "0.2"})
    pid = ready_info(unified, tmp_path)["sglang_pid"]
    with grpc.insecure_channel(unified.address) as ch:
        stub = decode_service_pb2_grpc.DecodeServiceStub(ch)
        req = dpb.GenerateUnifiedRequest(
            request_id="d1", token_ids=[1, 2], sampling=types_pb2.SamplingParams(max_tokens=200)
        )
        stream = stub.GenerateUnified(req, timeout=30)
        next(stream)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as info:
            list(stream)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert _reason(info.value) == "PEER_UNAVAILABLE"
    assert unified.proc.wait(30) == 1


def test_sigterm_lets_a_request_in_flight_finish(start_sglang_peer: Start) -> None:
    env = {"XAVIER_STANDIN_TOKEN_DELAY": "0.1", "XAVIER_GRACE_SECONDS": "8"}
    unified = start_sglang_peer("unified", env=env)
    with grpc.insecure_channel(unified.address) as ch:
        stub = decode_service_pb2_grpc.DecodeServiceStub(ch)
        req = dpb.GenerateUnifiedRequest(
            request_id="t1", token_ids=[4, 5], sampling=types_pb2.SamplingParams(max_tokens=12)
        )
        stream = stub.GenerateUnified(req, timeout=30)
        first = next(stream)
        unified.proc.send_signal(signal.SIGTERM)
        # While the request in flight finishes, a new one is refused (so the wait for it ends).
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        _wait(lambda: health_status(unified.address) == not_serving, 5, "NOT_SERVING after SIGTERM")
        refused = ""
        for i in range(20):
            probe = dpb.GenerateUnifiedRequest(
                request_id=f"late-{i}", token_ids=[4, 5], sampling=types_pb2.SamplingParams(max_tokens=1)
            )
            try:
                list(stub.GenerateUnified(probe, timeout=10))
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE
                refused = _reason(err)
                break
            time.sleep(0.02)
        assert refused == "SHUTTING_DOWN"
        rest = list(stream)
    ids = [*first.delta.token_ids, *(t for m in rest for t in m.delta.token_ids)]
    assert ids == _expected([4, 5], 12) and rest[-1].finish_reason == types_pb2.FINISH_REASON_LENGTH
    assert unified.proc.wait(20) == 0


def test_a_setup_that_cannot_work_exits_2_naming_the_key(start_sglang_peer: Start) -> None:
    with pytest.raises(RuntimeError) as info:
        start_sglang_peer("decode", env={"XAVIER_SGLANG__HICACHE": "true"}, timeout=30)
    assert "exited with 2" in str(info.value) and "config error: sglang.hicache" in str(info.value)


def test_an_unhealthy_sglang_makes_the_service_not_serving_until_it_recovers(
    start_sglang_peer: Start, tmp_path: Path
) -> None:
    env = {"XAVIER_SGLANG__HEALTH_INTERVAL_SECONDS": "0.2", "XAVIER_SGLANG__UNHEALTHY_AFTER": "2"}
    unified = start_sglang_peer("unified", env=env)
    url = ready_info(unified, tmp_path)["sglang_url"]
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING

    def set_health(ok: bool) -> None:
        req = urllib.request.Request(f"{url}/standin/health?ok={int(ok)}", method="POST")
        urllib.request.urlopen(req, timeout=5).close()

    assert health_status(unified.address) == serving
    set_health(False)
    _wait(lambda: health_status(unified.address) == not_serving, 10, "NOT_SERVING after failed probes")
    set_health(True)
    _wait(lambda: health_status(unified.address) == serving, 10, "SERVING after a passing probe")
    assert unified.proc.poll() is None  # a hung SGLang is reported, not killed


def test_an_sglang_pair_says_its_decode_streams_the_first_token(
    start_sglang_peer: Start, directory: ServiceProc, tmp_path: Path
) -> None:
    prefill = start_sglang_peer("prefill")
    decode = start_sglang_peer("decode")
    peers = {p.address: p for p in _peers(directory)}
    source = types_pb2.FIRST_TOKEN_SOURCE_DECODE
    # The plugin registers them declaring no source: the router reads it from the engine they are.
    assert {first_token_source(peers[s.address]) for s in (prefill, decode)} == {source}
    p = peers[prefill.address]
    sampling = types_pb2.SamplingParams(max_tokens=3, ignore_eos=True)
    with grpc.insecure_channel(prefill.address) as pch, grpc.insecure_channel(decode.address) as dch:
        decode_stub = decode_service_pb2_grpc.DecodeServiceStub(dch)
        base = dpb.DecodeRequest(
            room_id=43, prefill_peer_id=p.peer_id, prefill_epoch=p.epoch, token_ids=[7, 8], sampling=sampling
        )
        # Handed a first token, it would stream it twice: refused, naming the field.
        handed = dpb.DecodeRequest(first_token_source=types_pb2.FIRST_TOKEN_SOURCE_PREFILL, first_token=5)
        handed.MergeFrom(base)
        with pytest.raises(grpc.RpcError) as info:
            list(decode_stub.Decode(handed, timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "first_token_source" in (info.value.details() or "")
        # The pair's two calls at once, as the router makes them: the prefill's answer carries no first
        # token (SGLang returned one; the decode's stream begins with it).
        base.first_token_source = source
        prefill_stub = prefill_service_pb2_grpc.PrefillServiceStub(pch)
        answer = prefill_stub.Prefill.future(
            ppb.PrefillRequest(room_id=43, decode_peer_id="d", token_ids=[7, 8], sampling=sampling),
            timeout=30,
        )
        streamed = [t for msg in decode_stub.Decode(base, timeout=30) for t in msg.delta.token_ids]
        pf = answer.result(timeout=30)
    assert streamed == _expected([7, 8], 3)
    assert pf.first_token_source == source and pf.first_token == 0
