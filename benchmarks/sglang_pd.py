"""SGLang P/D through Xavier against SGLang's own NIXL P/D and one SGLang server, on the GPUs given.

Modes (each started, measured and stopped in turn; rounds alternate the order; with `--interleave` all
are up at once and every level runs on each mode back to back, the order alternating level to level):

* `native`, `pd`, `colocated`: `xavier up --engine sglang --mode M`, the workload through the router's
  OpenAI API (`/v1/completions`, token-id prompts, streamed);
* `direct-native`, `direct-xavier`: an SGLang prefill + decode pair started here without the router or
  the hosting services (`direct-xavier` with a Xavier directory and `--disaggregation-transfer-backend
  xavier`), driven as SGLang's own load balancer drives native P/D: the same `/generate` body to both
  servers, the decode's stream read. Backend cost and router/hosting cost are so seen apart.

The workload is the one of `../shared/reference/sglang-gpu/one-gpu/workload.py`: prompts of 24-1,300 token
ids, 64 tokens out, `ignore_eos`, greedy; `repeat` reuses 8 prompts, `unique` makes every prompt new.
Each mode first serves `--warm-up` unmeasured prompts (kernels compiled on first use are paid there, not by
whichever mode runs the first level). Per level: output tok/s, TTFT and TPOT p50/p99, errors, the CPU seconds
each process spent per request (from /proc), and, for the xavier backend, a breakdown of the handoff from the
plugin's per-room trace (`XAVIER_SGLANG_TRACE`). With `--py-spy S`, the c32 `repeat` level of each mode is
sampled by py-spy (if installed) and the busiest Python frames of each process are reported. Greedy outputs of
the first prompts are kept per mode, and `outputs_equal` says whether every mode produced the same tokens
(`outputs_compared`: which modes, and at how many levels, went into each comparison).

    python benchmarks/sglang_pd.py --gpus 0,0 --out docs/results/sglang-pd-h200
    python benchmarks/sglang_pd.py --modes direct-native,direct-xavier --concurrency 32 --kinds repeat
    python benchmarks/sglang_pd.py --modes native@w1,pd --router-workers 2 --baseline native@w1 --interleave

Both P/D roles on one GPU: `--gpus 0,0` (servers start one after another, since SGLang sizes its KV pool
from the memory free when it starts). Prints JSON; writes <out>.json and <out>.png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp

LENS = (24, 31, 40, 52, 700, 900, 1100, 1300)
T0 = time.monotonic()
"""When this script started: `--stop-after` counts from here."""
ROOT = Path(__file__).resolve().parents[1]
UP_MODES = ("native", "pd", "colocated")
DIRECT_MODES = ("direct-native", "direct-xavier")


def mode_parts(name: str) -> tuple[str, int | None]:
    """`("pd", 1)` of `pd@w1`: a mode's kind and the router processes its `@wN` suffix names (None without
    one); ValueError names what is wrong with the suffix."""
    kind, at, suffix = name.partition("@")
    if not at:
        return kind, None
    if kind not in UP_MODES or not suffix.startswith("w") or not suffix[1:].isdigit() or int(suffix[1:]) < 1:
        raise ValueError(f"mode {name!r}: only an up mode takes a router-process count, as `pd@w2`")
    return kind, int(suffix[1:])


def mode_kind(name: str) -> str:
    """`pd` of `pd@w1`: a mode's name with its router-process suffix (`@wN`, an up mode with N router
    processes instead of `--router-workers`'s count) left off."""
    return mode_parts(name)[0]


def router_workers(name: str, args: argparse.Namespace) -> int:
    """How many router processes up mode `name` runs: its `@wN` suffix, else `--router-workers`."""
    workers = mode_parts(name)[1]
    return int(args.router_workers) if workers is None else workers


def check_modes(modes: Sequence[str]) -> str | None:
    """What is wrong with a `--modes` list, or None."""
    for name in modes:
        try:
            kind, _ = mode_parts(name)
        except ValueError as exc:
            return str(exc)
        if kind not in UP_MODES + DIRECT_MODES:
            return f"unknown mode {name!r} (one of {', '.join(UP_MODES + DIRECT_MODES)})"
    if len(set(modes)) != len(modes):
        return "a mode is listed twice"
    return None


SGLANG_LAUNCHER = json.dumps([sys.executable, "-m", "sglang.launch_server"])
"""`xavier up --sglang-command`: SGLang's server from this interpreter."""
SGLANG_ARGS = [
    "--attention-backend", "triton", "--sampling-backend", "pytorch", "--mem-fraction-static", "0.3",
    "--max-total-tokens", "400000", "--cuda-graph-max-bs", "64", "--log-level", "warning",
]  # fmt: skip


def pct(xs: list[float], q: float) -> float | None:
    """The q-quantile of `xs` in seconds, to the microsecond (a TPOT of 3 ms is compared at 1.05x)."""
    ys = sorted(xs)
    return round(ys[min(len(ys) - 1, int(len(ys) * q))], 6) if ys else None


def prompt(kind: str, i: int) -> list[int]:
    """The i-th prompt of a kind (`warm-up`: unique prompts no level sends)."""
    if kind == "warm-up":
        return prompt("unique", 1_000_000 + i)
    if kind == "repeat":
        rng = random.Random(0)
        distinct = [[rng.randrange(1000, 100000) for _ in range(n)] for n in LENS]
        return distinct[i % len(distinct)]
    r = random.Random(1000 + i)
    return [r.randrange(1000, 100000) for _ in range(LENS[i % len(LENS)])]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- processes -----------------------------------------------------------------------------------


def tree(root: int) -> list[int]:
    """`root` and its descendants (from /proc)."""
    children: dict[int, list[int]] = defaultdict(list)
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = (d / "stat").read_text()
                ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
                children[ppid].append(int(d.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def proc_name(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return f"pid{pid}"
    words = [a.decode(errors="replace") for a in argv if a]
    if "--worker-index" in words[:-1]:  # a router worker (`xavier up --router-workers`)
        return f"xavier-router:w{words[words.index('--worker-index') + 1]}:{pid}"
    for flag in ("--disaggregation-mode", "--peer-id", "--role"):
        if flag in words and words.index(flag) + 1 < len(words):
            return f"{comm}:{words[words.index(flag) + 1]}:{pid}"
    return f"{comm}:{pid}"


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = Path(f"/proc/{pid}/stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            out[pid] = (int(fields[11]) + int(fields[12])) / tick
    return out


def wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes], log: Path) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        with contextlib.suppress(OSError):
            urllib.request.urlopen(url + "/health", timeout=2)
            return
        time.sleep(1)
    raise TimeoutError(f"{url} not healthy after {timeout:.0f}s:\n{log.read_text()[-4000:]}")


def stop(proc: subprocess.Popen[bytes], grace: float = 60.0) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


class Mode:
    """One running mode: where to send requests and which processes are its own."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.procs: list[subprocess.Popen[bytes]] = []
        self.base = ""
        self.prefill = ""
        self.bootstrap: tuple[str, int] | None = None
        self.trace: Path | None = None

    def pids(self) -> list[int]:
        return [p for proc in self.procs for p in tree(proc.pid)]

    def close(self) -> None:
        for proc in reversed(self.procs):
            stop(proc)


def launch_up(
    updir: Path, flags: list[str], env: dict[str, str] | None = None, timeout: float = 900.0
) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """`xavier up <flags>` from a fresh `updir` (ephemeral ports, the services' files in `updir/svc`, its
    output in `updir/up.log`); returns its process and its ready file once written. Stops it and raises
    with the log's tail when it exits first or `timeout` passes."""
    shutil.rmtree(updir, ignore_errors=True)
    updir.mkdir(parents=True)
    ready, log = updir / "up.json", updir / "up.log"
    cmd = [sys.executable, "-m", "xavier_cli", "up", "--grpc", "127.0.0.1:0", "--http", "127.0.0.1:0",
           "--workdir", str(updir / "svc"), "--ready-file", str(ready), "--timeout", "900",
           *flags]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise RuntimeError(
                f"xavier up {' '.join(flags)} failed:\n{log.read_text(errors='replace')[-6000:]}"
            )
        time.sleep(0.5)
    return proc, json.loads(ready.read_text())


def start_up(name: str, args: argparse.Namespace, work: Path, env: dict[str, str]) -> Mode:
    mode = Mode(name)
    mode.trace = work / name / "trace"
    kind = mode_kind(name)
    replicas = ["--unified", "1"] if kind == "colocated" else []
    gpus = args.gpus.split(",")[:1] if kind == "colocated" else args.gpus.split(",")
    flags = ["--engine", "sglang", "--mode", kind, "--model", str(args.model), "--no-pagestore",
             "--gpus", ",".join(gpus), "--sglang-command", SGLANG_LAUNCHER, *replicas,
             *(["--insecure"] if args.insecure else []), "--router-workers", str(router_workers(name, args)),
             *(f"--sglang-arg={a}" for a in args.sglang_args)]  # fmt: skip
    proc, ready = launch_up(work / name, flags, {**env, "XAVIER_SGLANG_TRACE": str(mode.trace)})
    mode.procs.append(proc)
    mode.base = "http://" + ready["http"]
    return mode


def _sglang(
    role: str, port: int, gpu: str, extra: list[str], args: argparse.Namespace, log: Path, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(args.model), "--host",
           "127.0.0.1", "--port", str(port), "--page-size", "16", "--base-gpu-id", gpu,
           "--disaggregation-mode", role, *extra, *args.sglang_args]  # fmt: skip
    if role == "decode":
        cmd.append("--disable-radix-cache")
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def start_direct(name: str, args: argparse.Namespace, work: Path, env: dict[str, str]) -> Mode:
    mode = Mode(name)
    d = work / name
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    gpus = args.gpus.split(",")
    pgpu, dgpu = gpus[0], gpus[1 % len(gpus)]
    pport, dport = free_port(), free_port()
    try:
        if name == "direct-native":
            boot = free_port()
            penv = denv = env
            pextra = [
                "--disaggregation-transfer-backend",
                "nixl",
                "--disaggregation-bootstrap-port",
                str(boot),
            ]
            dextra = ["--disaggregation-transfer-backend", "nixl"]
            mode.bootstrap = ("127.0.0.1", boot)
        else:
            ready = d / "directory.json"
            dlog = d / "directory.log"
            with open(dlog, "wb") as out:
                directory = subprocess.Popen(
                    ["xavier-directory", "--listen", "127.0.0.1:0", "--ready-file", str(ready)],
                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env,
                )  # fmt: skip
            mode.procs.append(directory)
            deadline = time.monotonic() + 60
            while not ready.exists():
                if directory.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"directory failed:\n{dlog.read_text()}")
                time.sleep(0.2)
            address = json.loads(ready.read_text())["address"]
            mode.trace = d / "trace"
            # The advertised address is the name a decode finds its prefill by (nothing listens there).
            advertise = ("127.0.0.1", free_port())
            common = {
                "SGLANG_PLUGINS": "xavier",
                "XAVIER_DIRECTORY": address,
                "XAVIER_SGLANG_TRACE": str(mode.trace),
            }
            penv = {**env, **common, "XAVIER_SGLANG_ADVERTISE": f"{advertise[0]}:{advertise[1]}"}
            denv = {**env, **common, "XAVIER_SGLANG_ADVERTISE": f"127.0.0.1:{free_port()}"}
            pextra = dextra = ["--disaggregation-transfer-backend", "xavier"]
            mode.bootstrap = advertise
        plog, dlog2 = d / "prefill.log", d / "decode.log"
        prefill = _sglang("prefill", pport, pgpu, pextra, args, plog, penv)
        mode.procs.append(prefill)
        # One after another: SGLang sizes its KV pool from the memory free when it starts.
        wait_http(f"http://127.0.0.1:{pport}", 900, prefill, plog)
        decode = _sglang("decode", dport, dgpu, dextra, args, dlog2, denv)
        mode.procs.append(decode)
        wait_http(f"http://127.0.0.1:{dport}", 900, decode, dlog2)
    except BaseException:
        mode.close()
        raise
    mode.prefill, mode.base = f"http://127.0.0.1:{pport}", f"http://127.0.0.1:{dport}"
    return mode


# --- the workload --------------------------------------------------------------------------------


Record = tuple[float, float | None, float, int, str | None, Any]


class _StreamError(Exception):
    """A streamed answer that failed: an HTTP status other than 200, or an error event."""


async def _events(r: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of a server-sent stream, up to `[DONE]`."""
    if r.status != 200:
        raise _StreamError(f"http {r.status}: {(await r.text())[:200]}")
    async for raw in r.content:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        ev = json.loads(line[5:])
        if ev.get("error"):
            raise _StreamError(str(ev["error"])[:200])
        yield ev


async def _openai(
    s: aiohttp.ClientSession, mode: Mode, model: str, ids: list[int], max_tokens: int
) -> Record:
    t0 = time.perf_counter()
    first, n, err, toks = None, 0, None, []
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    try:
        async with s.post(mode.base + "/v1/completions", json=body) as r:
            async for ev in _events(r):
                if ev.get("choices") and first is None:
                    first = time.perf_counter()
                toks += [ch.get("text") or "" for ch in ev.get("choices") or []]
                if ev.get("usage"):
                    n = ev["usage"].get("completion_tokens", 0)
    except Exception as e:
        err = str(e) if isinstance(e, _StreamError) else repr(e)[:200]
    return t0, first, time.perf_counter(), n, err, "".join(toks)


async def _direct(s: aiohttp.ClientSession, mode: Mode, ids: list[int], max_tokens: int) -> Record:
    t0 = time.perf_counter()
    first, err, toks = None, None, []
    assert mode.bootstrap is not None
    room = random.getrandbits(63) or 1
    sampling = {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    host, port = mode.bootstrap
    body = {"input_ids": ids, "sampling_params": sampling, "bootstrap_host": host, "bootstrap_port": port,
            "bootstrap_room": room}  # fmt: skip

    async def prefill() -> None:
        async with s.post(mode.prefill + "/generate", json=body) as r:
            await r.read()

    pf = asyncio.ensure_future(prefill())
    try:
        async with s.post(mode.base + "/generate", json={**body, "stream": True}) as r:
            async for ev in _events(r):
                out = ev.get("output_ids") or []
                if out and first is None:
                    first = time.perf_counter()
                toks = list(out)
                fin = (ev.get("meta_info") or {}).get("finish_reason")
                if isinstance(fin, dict) and fin.get("type") == "abort":
                    err = str(fin.get("message"))[:200]
        await pf
    except Exception as e:
        err = str(e) if isinstance(e, _StreamError) else repr(e)[:200]
        pf.cancel()
    return t0, first, time.perf_counter(), len(toks), err, toks


async def workload(mode: Mode, kind: str, conc: int, nreq: int, max_tokens: int) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=900)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as s:
        model = ""
        if mode_kind(mode.name) in UP_MODES:
            model = (await (await s.get(mode.base + "/v1/models")).json())["data"][0]["id"]
        sem = asyncio.Semaphore(conc)

        async def one(i: int) -> Record:
            async with sem:
                ids = prompt(kind, i)
                if mode_kind(mode.name) in UP_MODES:
                    return await _openai(s, mode, model, ids, max_tokens)
                return await _direct(s, mode, ids, max_tokens)

        await asyncio.gather(*[one(i) for i in range(min(conc, 16))])  # warm-up
        pids = mode.pids()
        cpu0 = cpu_seconds(pids)
        t = time.perf_counter()
        rec = await asyncio.gather(*[one(i) for i in range(nreq)])
        dt = time.perf_counter() - t
        cpu1 = cpu_seconds(pids)
    ok = [r for r in rec if r[4] is None and r[1] is not None]
    errs = [r[4] for r in rec if r[4] is not None]
    ttft = [r[1] - r[0] for r in ok if r[1] is not None]
    tpot = [(r[2] - r[1]) / (r[3] - 1) for r in ok if r[1] is not None and r[3] > 1]
    cpu = {proc_name(p): round((cpu1[p] - cpu0.get(p, 0.0)) * 1000 / nreq, 3) for p in cpu1}
    # The cores the router's processes kept busy (all its workers): at about one a process is the ceiling.
    router_ms = sum(v for k, v in cpu.items() if k.startswith("xavier-router"))
    return {
        "mode": mode.name, "kind": kind, "concurrency": conc, "requests": nreq, "ok": len(ok),
        "errors": len(errs), "first_error": errs[0] if errs else None,
        "all_full": all(r[3] == max_tokens for r in ok), "out_tok_s": round(sum(r[3] for r in ok) / dt, 1),
        "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99), "tpot_p50": pct(tpot, 0.5),
        "tpot_p99": pct(tpot, 0.99), "tpot_mean": round(statistics.fmean(tpot), 6) if tpot else None,
        "wall_s": round(dt, 2), "router_cores": round(router_ms * nreq / dt / 1000, 3),
        "cpu_ms_per_request": {k: v for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]) if v >= 0.05},
        "outputs": [r[5] for r in rec[: len(LENS)]],
    }  # fmt: skip


# --- the plugin's per-room trace -----------------------------------------------------------------


def read_trace(folder: Path | None) -> dict[str, dict[int, dict[str, Any]]]:
    sides: dict[str, dict[int, dict[str, Any]]] = {"prefill": {}, "decode": {}}
    if folder is None or not folder.is_dir():
        return sides
    for f in folder.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            with contextlib.suppress(ValueError, KeyError):
                row = json.loads(line)
                sides[row["side"]][int(row["room"])] = row
    return sides


def breakdown(sides: dict[str, dict[int, dict[str, Any]]], since: float) -> dict[str, Any]:
    """Median milliseconds between the steps of rooms traced on both sides since `since`."""
    gaps: dict[str, list[float]] = defaultdict(list)
    polls: dict[str, list[int]] = defaultdict(list)
    outcomes: Counter[str] = Counter()
    for room, dec in sides["decode"].items():
        pre = sides["prefill"].get(room)
        if pre is None or dec["t"].get("created", 0) < since:
            continue
        outcomes[dec["outcome"]] += 1
        t = {f"decode.{k}": v for k, v in dec["t"].items()} | {f"prefill.{k}": v for k, v in pre["t"].items()}
        origin = min(t.values())
        for k, v in t.items():
            gaps[k].append((v - origin) * 1000)
        polls["decode"].append(dec["polls"])
        polls["prefill"].append(pre["polls"])
    steps = {k: round(statistics.median(v), 2) for k, v in gaps.items()}
    return {
        "rooms": sum(outcomes.values()), "outcomes": dict(outcomes),
        "median_ms_from_first_step": dict(sorted(steps.items(), key=lambda kv: kv[1])),
        "median_polls": {k: statistics.median(v) for k, v in polls.items()},
    }  # fmt: skip


# --- py-spy ------------------------------------------------------------------------------------------


def py_spy_start(mode: Mode, seconds: float, out: Path) -> list[subprocess.Popen[bytes]]:
    """py-spy on each of the mode's root processes and their children (none if py-spy is missing)."""
    exe = shutil.which("py-spy")
    if exe is None:
        return []
    return [
        subprocess.Popen(
            [
                exe,
                "record",
                "--nonblocking",
                "--subprocesses",
                "-r",
                "200",
                "-d",
                str(int(seconds)),
                "-f",
                "raw",
                "-o",
                f"{out}.{i}",
                "--pid",
                str(proc.pid),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for i, proc in enumerate(mode.procs)
    ]


def py_spy_summary(out: Path, top: int = 12) -> dict[str, Any]:
    """Per process: samples, the busiest leaf frames and inclusive frames (from py-spy's raw output)."""
    per: dict[str, Counter[str]] = defaultdict(Counter)
    incl: dict[str, Counter[str]] = defaultdict(Counter)
    total: Counter[str] = Counter()
    for f in out.parent.glob(out.name + ".*"):
        if not f.is_file():
            continue
        for line in f.read_text(errors="replace").splitlines():
            stack, _, count = line.rpartition(" ")
            if not count.isdigit():
                continue
            frames = stack.split(";")
            proc = frames[0][:80] if frames and frames[0].startswith("process") else "?"
            frames = [fr for fr in frames if not fr.startswith(("process", "thread"))]
            n = int(count)
            total[proc] += n
            if frames:
                per[proc][frames[-1][:160]] += n
                for fr in set(frames):
                    incl[proc][fr[:160]] += n
    return {
        p: {"samples": total[p], "leaf": per[p].most_common(top), "inclusive": incl[p].most_common(top)}
        for p, _ in total.most_common(8)
    }


# --- main ----------------------------------------------------------------------------------------


def make_model(path: Path, shape: dict[str, int] | None = None) -> Path:
    """A random fp16 Qwen2 checkpoint of `shape` (default: Qwen2.5-0.5B's) at `path`, kept if there."""
    if (path / "config.json").is_file():
        return path
    from xavier_core.engine.tiny import QWEN25_05B, make_tiny

    return make_tiny(path, "qwen2", dtype="float16", **(shape or QWEN25_05B))


def start_mode(name: str, args: argparse.Namespace, work: Path, env: dict[str, str]) -> tuple[Mode, float]:
    t0 = time.monotonic()
    mode = (start_up if mode_kind(name) in UP_MODES else start_direct)(name, args, work, env)
    started = round(time.monotonic() - t0, 1)
    if args.warm_up:  # kernels compiled on first use (Triton) are paid here, not by a mode's first level
        warm = asyncio.run(workload(mode, "warm-up", 64, args.warm_up, args.max_tokens))
        print(json.dumps({"mode": name, "warm_up": {k: warm[k] for k in ("ok", "errors", "wall_s")}}),
              file=sys.stderr, flush=True)  # fmt: skip
    print(json.dumps({"mode": name, "started_s": started}), file=sys.stderr, flush=True)
    return mode, started


def levels(args: argparse.Namespace) -> list[tuple[str, int]]:
    return [(kind, int(c)) for kind in args.kinds.split(",") for c in args.concurrency.split(",")]


def run_level(
    mode: Mode, started: float, kind: str, conc: int, args: argparse.Namespace, work: Path
) -> dict[str, Any]:
    """One workload level on a running mode, with its handoff breakdown (and py-spy at c32 repeat)."""
    since = time.time()
    spy: list[subprocess.Popen[bytes]] = []
    spy_out = work / f"pyspy-{mode.name}-{kind}-{conc}.txt"
    if args.py_spy and conc == 32 and kind == "repeat":
        spy = py_spy_start(mode, args.py_spy, spy_out)
    row = asyncio.run(workload(mode, kind, conc, args.requests, args.max_tokens))
    row["started_s"] = started
    row["interleaved"] = args.interleave  # for a summary made later from the rows (`--summarize`)
    if mode_kind(mode.name) in UP_MODES:
        row["router_workers"] = router_workers(mode.name, args)
    for sampler in spy:
        with contextlib.suppress(subprocess.TimeoutExpired):
            sampler.wait(args.py_spy + 30)
    if spy:
        row["py_spy"] = py_spy_summary(spy_out)
    time.sleep(1.0)  # rooms cleared by SGLang write their trace lines
    row["handoff"] = breakdown(read_trace(mode.trace), since)
    print(json.dumps({k: v for k, v in row.items() if k not in ("outputs", "py_spy")}), flush=True)
    if args.rows_log is not None:  # a run cut short still leaves the levels it measured, outputs included
        with open(args.rows_log, "a") as f:
            f.write(json.dumps({k: v for k, v in row.items() if k != "py_spy"}) + "\n")
    return row


def run_mode(
    name: str, args: argparse.Namespace, work: Path, env: dict[str, str]
) -> Iterator[dict[str, Any]]:
    mode, started = start_mode(name, args, work, env)
    try:
        for kind, conc in levels(args):
            yield run_level(mode, started, kind, conc, args, work)
    finally:
        mode.close()


def run_interleaved(
    modes: list[str], args: argparse.Namespace, work: Path, env: dict[str, str]
) -> list[dict[str, Any]]:
    """Every mode up at once (started one after another: a GPU's free memory is read at each start),
    then each level run on every mode back to back, the order of the modes reversed from one level
    to the next and from one round to the next, so no mode always goes first."""
    running: list[tuple[Mode, float]] = []
    rows: list[dict[str, Any]] = []
    try:
        for name in modes:
            running.append(start_mode(name, args, work, env))
        step = 0
        for rnd in range(args.rounds):
            for kind, conc in levels(args):
                if args.stop_after and time.monotonic() - T0 > args.stop_after:
                    starts = {m.name: s for m, s in running}  # a run that measured nothing says why
                    print(
                        json.dumps(
                            {
                                "stopped": f"--stop-after {args.stop_after} s",
                                "round": rnd,
                                "started_s": starts,
                            }
                        ),
                        flush=True,
                    )
                    return rows
                for mode, started in running if step % 2 == 0 else running[::-1]:
                    row = run_level(mode, started, kind, conc, args, work)
                    row["round"] = rnd
                    rows.append(row)
                step += 1
            step += len(levels(args)) % 2 == 0  # the next round starts with the other order
    finally:
        for mode, _ in reversed(running):
            mode.close()
    return rows


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    kinds = sorted({r["kind"] for r in rows})
    fig, axes = plt.subplots(1, 2 * len(kinds), figsize=(6 * 2 * len(kinds), 4))
    for k, kind in enumerate(kinds):
        for mode in sorted({r["mode"] for r in rows}):
            pts: dict[int, list[float]] = defaultdict(list)
            ttft: dict[int, list[float]] = defaultdict(list)
            for r in rows:
                if r["mode"] == mode and r["kind"] == kind:
                    pts[r["concurrency"]].append(r["out_tok_s"])
                    ttft[r["concurrency"]].append((r["ttft_p50"] or 0) * 1000)
            xs = sorted(pts)
            axes[2 * k].plot(xs, [statistics.median(pts[x]) for x in xs], marker="o", label=mode)
            axes[2 * k + 1].plot(xs, [statistics.median(ttft[x]) for x in xs], marker="o", label=mode)
        axes[2 * k].set(title=f"output tok/s ({kind})", xlabel="concurrency")
        axes[2 * k + 1].set(title=f"TTFT p50 ms ({kind})", xlabel="concurrency")
        axes[2 * k].legend()
    fig.tight_layout()
    fig.savefig(out)


FIGURES = ("out_tok_s", "ttft_p50", "tpot_p50", "tpot_mean")
"""A level's figures that the summary compares across rounds and modes."""


def by_level(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """The measured rows (failed ones left out) per mode and level (`kind/concurrency`), in run order."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if "out_tok_s" in r:
            groups[(r["mode"], f"{r['kind']}/{r['concurrency']}")].append(r)
    return groups


def medians(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per mode and level (`kind/concurrency`), the median over rounds of tok/s, TTFT p50 and TPOT p50 and
    mean (rows of earlier runs have no mean)."""
    out: dict[str, dict[str, dict[str, float]]] = defaultdict(dict)
    for (mode, level), rs in sorted(by_level(rows).items()):
        out[mode][level] = {
            k: statistics.median(r[k] for r in rs if r.get(k) is not None)
            for k in FIGURES
            if any(r.get(k) is not None for r in rs)
        } | {"rounds": len(rs)}
    return dict(out)


def paired_ratios(
    runs: Sequence[Sequence[dict[str, Any]]], base: str = "native"
) -> dict[str, dict[str, dict[str, float]]]:
    """Per mode other than `base` and level, the median over rounds of the ratio of that round's figure to
    `base`'s in the same round, for tok/s, TTFT p50 and TPOT p50 and mean: the in-run baseline, free of the
    drift between rounds that per-mode medians keep. Within each run (the rows of one benchmark run) a
    mode's k-th run of a level pairs with `base`'s k-th (interleaved runs put them back to back); the pairs
    of all runs are pooled."""
    pairs: dict[tuple[str, str], list[tuple[dict[str, Any], dict[str, Any]]]] = defaultdict(list)
    for rows in runs:
        levels = by_level(rows)
        for (mode, level), rs in levels.items():
            if mode != base and (base, level) in levels:
                pairs[(mode, level)] += zip(rs, levels[(base, level)], strict=False)
    out: dict[str, dict[str, dict[str, float]]] = defaultdict(dict)
    for (mode, level), ps in sorted(pairs.items()):
        ratios = {
            k: round(statistics.median(a[k] / b[k] for a, b in ps if a.get(k) and b.get(k)), 4)
            for k in FIGURES
            if any(a.get(k) and b.get(k) for a, b in ps)
        }
        out[mode][level] = ratios | {"pairs": len(ps)}
    return dict(out)


def _output_family(row: dict[str, Any]) -> str:
    """Rows whose outputs compare: through the router (text) or direct (token ids), per prompt kind."""
    return ("direct" if mode_kind(row["mode"]) in DIRECT_MODES else "router") + "/" + row["kind"]


def outputs_equal(rows: list[dict[str, Any]]) -> dict[str, bool]:
    """Per family (through the router: text; direct: token ids) and kind, whether every mode and level
    gave the same greedy outputs for the first prompts (see `outputs_compared` for which modes did)."""
    seen: dict[str, Any] = {}
    equal: dict[str, bool] = {}
    for r in rows:
        if "outputs" not in r:
            continue
        key = _output_family(r)
        ref = seen.setdefault(key, r["outputs"])
        equal[key] = equal.get(key, True) and r["outputs"] == ref
    return equal


def outputs_compared(rows: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per family of `outputs_equal`, the modes whose outputs went into it and how many levels each: a
    family with one mode compared nothing across modes, whatever `outputs_equal` says."""
    out: dict[str, Counter[str]] = defaultdict(Counter)
    for r in rows:
        if "outputs" in r:
            out[_output_family(r)][r["mode"]] += 1
    return {key: dict(sorted(modes.items())) for key, modes in sorted(out.items())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="checkpoint (default: a Qwen2.5-0.5B-shaped one)")
    p.add_argument(
        "--modes",
        default="native,pd,colocated,direct-native,direct-xavier",
        help="an up mode may name its router processes, `pd@w1`: it then runs beside the same mode with "
        "another count",
    )
    p.add_argument("--baseline", default="native", help="the mode each round's ratios are taken over")
    p.add_argument("--gpus", default="0,0", help="prefill,decode GPUs (colocated uses the first)")
    p.add_argument("--concurrency", default="16,32,64")
    p.add_argument("--kinds", default="repeat,unique")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1, help="rounds; each reverses the previous order")
    p.add_argument("--warm-up", type=int, default=128, metavar="N", help="unmeasured prompts at c64 first")
    p.add_argument(
        "--interleave",
        action="store_true",
        help="every mode up at once, each level run on every mode in turn (orders alternating)",
    )
    p.add_argument("--py-spy", type=float, default=0.0, metavar="S", help="sample c32 repeat for S seconds")
    p.add_argument("--sglang-arg", dest="sglang_args", action="append", default=None)
    p.add_argument(
        "--router-workers",
        type=int,
        default=1,
        metavar="N",
        help="xavier up --router-workers (every up mode)",
    )
    p.add_argument(
        "--insecure", action="store_true", help="xavier up without mTLS (the runs of 2026-12-01 and before)"
    )
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--rows-log", type=Path, default=None, help="append each level's row here as it ends")
    p.add_argument(
        "--stop-after",
        type=float,
        default=0.0,
        metavar="S",
        help="with --interleave, start no level once S seconds have passed (the summary is still written)",
    )
    p.add_argument(
        "--summarize",
        type=Path,
        nargs="+",
        default=None,
        metavar="LOG",
        help="run nothing: write the summary (JSON, PNG) of the rows the --rows-log LOGs hold (one per run: "
        "the ratios to native pair rounds within a run and pool the pairs of all)",
    )
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "sglang-pd")
    args = p.parse_args()
    args.sglang_args = args.sglang_args or list(SGLANG_ARGS)
    modes = args.modes.split(",")
    if (problem := check_modes(modes)) is not None:
        p.error(f"--modes: {problem}")
    if args.summarize is not None:
        runs = [
            [json.loads(ln) for ln in log.read_text().splitlines() if ln.strip()] for log in args.summarize
        ]
        rows = [r for run in runs for r in run]
        return summarize(args, sorted({r["mode"] for r in rows if "mode" in r}), rows, runs)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="sglang-pd-"))
    args.model = make_model(args.model or work / "qwen2.5-0.5b-shape")
    env = dict(os.environ)
    rows: list[dict[str, Any]] = []
    if args.interleave:
        try:
            rows = run_interleaved(modes, args, work, env)
        except (RuntimeError, TimeoutError) as exc:
            print(json.dumps({"modes": modes, "failed": str(exc)[-3000:]}), flush=True)
            rows.append({"mode": ",".join(modes), "failed": str(exc)[-3000:]})
    for rnd in range(0 if args.interleave else args.rounds):
        for name in modes if rnd % 2 == 0 else modes[::-1]:
            try:
                for row in run_mode(name, args, work, env):
                    row["round"] = rnd
                    rows.append(row)
            except (RuntimeError, TimeoutError) as exc:
                print(json.dumps({"mode": name, "failed": str(exc)[-3000:]}), flush=True)
                rows.append({"mode": name, "round": rnd, "failed": str(exc)[-3000:]})
    return summarize(args, modes, rows)


def summarize(
    args: argparse.Namespace,
    modes: list[str],
    rows: list[dict[str, Any]],
    runs: Sequence[Sequence[dict[str, Any]]] | None = None,
) -> int:
    """Writes the run's summary (every row, greedy-output equality, per-level medians and per-round ratios to
    the baseline mode, `ratios_to_baseline`; summaries before it was named call them `ratios_to_native`)
    and its plot."""
    interleaved = args.interleave or any(r.get("interleaved") for r in rows)
    summary = {"gpus": args.gpus, "modes": modes, "interleaved": interleaved, "baseline": args.baseline,
               "sglang_args": args.sglang_args, "rows": rows,
               "outputs_equal": outputs_equal(rows), "outputs_compared": outputs_compared(rows),
               "medians": medians(rows),
               "ratios_to_baseline": paired_ratios(runs or [rows], args.baseline)}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    plot([r for r in rows if "out_tok_s" in r], args.out.with_suffix(".png"))
    short = {k: summary[k] for k in ("outputs_equal", "outputs_compared", "baseline", "ratios_to_baseline")}
    print(json.dumps({**short, "out": str(args.out)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
