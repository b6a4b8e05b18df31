"""Configuration shared by the engine-hosting services (prefill, decode, unified)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from xavier_core.runtime.config import Addresses, AddressOrOff, ServiceConfig
from xavier_services.peer.sglang_section import SglangSection


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineSection(_Section):
    """The hosted engine."""

    kind: Literal["reference", "sglang"] = "reference"
    """"reference": Xavier's engine in this process; "sglang": an SGLang server this service starts and
    supervises (the `[sglang]` section)."""
    model: Path | None = None
    """Local Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json)."""
    device: str = "cpu"
    dtype: Literal["float32", "float16", "bfloat16"] | None = None
    """None: float32 on CPU, float16 on CUDA."""
    page_size: int = Field(default=16, ge=1, le=1024)
    num_pages: int = Field(default=1024, ge=8, le=1 << 24)
    max_running: int = Field(default=32, ge=1, le=4096)
    max_queued: int = Field(default=1024, ge=1, le=1 << 20)
    """Requests waiting for their first step beyond which new generate/prefill calls are refused with
    RESOURCE_EXHAUSTED / ENGINE_QUEUE_FULL (decodes of already prefilled requests are never refused)."""
    chunk_tokens: int = Field(default=2048, ge=16, le=1 << 20)
    chunk_gather_bytes: int = Field(default=64 << 20, ge=0, le=1 << 40)  # decode_graph.CHUNK_GATHER_BYTES
    """On CUDA, a prefill chunk after cached keys (a prefix hit's suffix) replays the decode graphs, one
    row per token, only while those rows gather at most this many K/V bytes per layer; a longer context
    takes the general forward, which gathers it once. 0: never as rows."""
    compile: bool = False
    """On CUDA, the static-shape step that decode rows and prefix hits' suffixes replay from CUDA graphs is
    compiled by torch.compile first: the same math in fewer, fused kernels, in another summation order
    (fp16 logits move slightly: a greedy near-tie may pick the other token). On one H100 at the 0.5B
    shape it made a 16-token suffix step 2.0x faster and a page store hit's TTFT 0.66-0.84x eager's, and
    the start's capture 26.6 s instead of 13.3 s (64.3 s with torch's compile caches empty: README,
    "Measured"). Needs `device` cuda."""
    compute: Literal["model", "null"] = "model"
    """What each step runs: "model", the checkpoint's forward pass; "null", a near-zero-cost stand-in (no
    weights loaded) inside the otherwise real engine, for control-plane benchmarks. Null peers have their
    own KV contract fingerprint, so they never exchange KV with real ones."""

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if value != "cpu" and not value.startswith("cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {value!r}")
        return value


class PeerSection(_Section):
    """How this service joins the mesh."""

    peer_id: str = ""
    """Stable id kept across restarts (a restart gets a new epoch); empty: role-host-port."""
    directory: Addresses = "127.0.0.1:7100"
    """Directory gRPC address (several: directory replicas on etcd)."""
    advertise_host: str = "127.0.0.1"
    """Host other peers and the router use to reach this service."""
    rpc_timeout_seconds: float = Field(default=5.0, gt=0, le=600)
    """Deadline of each control RPC to the directory."""
    call_sessions: bool = True
    """Whether this peer declares that it serves its role's session RPC (`KvLayout.service_features`):
    a router then carries its calls to this peer as messages on one stream instead of one RPC each.
    Off, routers call it per RPC, as a peer of xavier.v1.0."""


class HandoffSection(_Section):
    """P/D handoff timing. Every wait is bounded by one of these (invariant I7)."""

    protocol: Literal["pair", "directory"] = "pair"
    """How this peer meets its partner for a request (`KvLayout.handoff`): "pair" (the prefill's answer
    carries the source, the router hands it to the decode, no directory call per request; used when both
    peers of a pair declare it) or "directory" (a directory room per request, xavier.v1.0's protocol)."""
    room_lease_seconds: float = Field(default=30.0, gt=0, le=86400)
    """Lease asked for a room; a room whose other side never comes ends within it. A pair handoff's
    source waits this long for its reader's word before it parks."""
    transfer_timeout_seconds: float = Field(default=30.0, gt=0, le=3600)
    """Longest a KV read may take before the decode gives up."""
    park_timeout_seconds: float = Field(default=60.0, gt=0, le=86400)
    """Longest an aborted source's pages stay parked waiting for a possibly in-flight read."""
    poll_interval_seconds: float = Field(default=0.0005, gt=0, le=1)
    """NIXL progress / notification polling period of a decode while its reads are live (and of a
    unified replica that shares its prefixes, which reads its peers' too, while its reads or shares are
    live)."""
    source_poll_interval_seconds: float = Field(default=0.005, gt=0, le=1)
    """The same on a prefill while its published sources wait for their reader's notification. Slower,
    as nothing on a request's path waits on it (the prefill also unpins when the decode's CompleteRoom
    reaches it through the room feed); a read over a transport that needs the source's progress (UCX
    over TCP) advances at this pace. Polling every 0.5 ms cost a prefill about 0.7 ms CPU per request."""
    share_prefixes: bool = False
    """Whether a unified replica shares the pages of the prefixes it holds with peer replicas
    (`DecodeService.SharePrefix`): it then opens a transfer port (one NIXL agent, the pool registered)
    and registers its endpoint in the directory, as a prefill does; and its page store fetches copy the
    hit pages a sharing peer wrote from that peer's pool (`peer/sharing.py`). Off, it has no port and
    refuses SharePrefix with SHARING_OFF. Other roles ignore it."""
    standing_share_seconds: float = Field(default=10.0, ge=0, le=600)
    """With `share_prefixes`: how long the pages a replica writes through to the page store stand in its
    pool afterwards, kept unchanged for readers: the store hands their pool pages to a reader's fetch
    (`GetPagesResponse.holder_page_runs`), which copies them at once, asking nothing (one SharePrefix round
    trip less). 0: nothing stands; a reader then asks (SharePrefix) each time."""
    standing_share_pool_fraction: float = Field(default=0.25, ge=0, le=1)
    """At most this share of the pool stands at once (`standing_share_seconds`); a write-through beyond
    it stands nothing. Standing pages cannot be evicted meanwhile."""
    warm_interval_seconds: float = Field(default=5.0, ge=0, le=3600)
    """How often a reader (a decode; a unified replica that shares its prefixes) lists the peers it reads
    from (its prefills; the other sharing replicas of its layout) and connects its transfer port to new
    ones, so that the first request to each does not wait for that (`peer/warming.py`). 0: off, the
    first pull from a peer connects."""
    read_end_agent: bool = True
    """Whether a decode tells a source that its read ended through a second NIXL agent of its own (no
    memory registered): its READs then carry no notification and end as soon as their bytes have moved
    (one-sided over CMA or RDMA), not at the source's next poll. Off, each READ carries its "done"
    notification, as in xavier.v1.0; a source takes either."""
    transfer_mode: Literal["coalesced", "per_page"] = "coalesced"
    """Descriptors per read: one per contiguous run (default) or one per page (baseline)."""
    transport: Literal["auto", "nixl", "cuda_ipc", "staged"] = "auto"
    """How KV moves: auto (CUDA IPC from a VRAM source on the same host with peer access, staged NIXL
    between VRAM pools otherwise, plain NIXL between DRAM pools), or forced. A VRAM source offers its
    pool through CUDA IPC unless this is nixl; a staged source gathers every room into its slab."""
    staging_slab_bytes: int = Field(default=256 << 20, ge=1 << 16, le=1 << 40)
    """Size of the staging slab (staged transport), allocated and registered once at start when the
    transport is staged, or auto on a VRAM pool. A room that finds no free chunk goes as plain NIXL."""
    staging_chunk_bytes: int = Field(default=4 << 20, ge=1 << 12, le=1 << 32)
    """Bytes per slab chunk (rounded down to whole page records, at least one): the unit of allocation
    and of one NIXL READ. Prefill and decode must agree, or pulls fall back to plain NIXL."""


class PageStoreSection(_Section):
    """The shared page store (prefill and unified roles). Every wait is bounded: a store that is down or
    slower than these deadlines is served as a miss (reads) or a dropped write, never a failed request."""

    address: AddressOrOff = ""
    """Page store gRPC address; empty: no store (only the local prefix cache)."""
    rpc_timeout_seconds: float = Field(default=0.5, gt=0, le=60)
    """Deadline of each store RPC; a slower store counts as down for that call."""
    transfer_timeout_seconds: float = Field(default=2.0, gt=0, le=600)
    """Longest a NIXL READ or WRITE of pages may take before it is cancelled (and counts as a miss)."""
    lease_seconds: float = Field(default=10.0, gt=0, le=3600)
    """Lease asked of the store for each read and write; it must cover the transfer and the commit."""
    write_queue: int = Field(default=64, ge=1, le=65536)
    """Write-throughs queued at most; more are dropped and counted."""
    staging_pages: int = Field(default=256, ge=1, le=1 << 20)
    """Pages of the pinned host mirror a GPU pool's store reads and writes pass through (the store is
    DRAM and pages are checksummed on the host; a second pinned buffer of the same size holds reads
    page-major for their check); also the most pages one store call moves."""
    read_piece_bytes: int = Field(default=0, ge=0, le=1 << 34)
    """A store read moves in pieces of about this many bytes, each checked (and, for a GPU pool, copied
    to the pool) while the next is on the wire; 0 (the default, faster on an H200 host): one READ per
    store call, checked once it landed."""
    stage_host_pool: bool = False
    """Pass a host pool through the mirror too: a GPU pool's exact path on a machine without one (tests,
    benchmarks)."""
    same_host_reads: bool = True
    """Read a store on this host straight out of its process's memory instead of by NIXL READs (false:
    always NIXL; a store elsewhere, or one whose memory cannot be read so, is read over NIXL anyway)."""
    check_while_reading: bool = True
    """Such a read checks each page as it lands, in the same pass over memory (where the page loop is
    built); false: it reads every page first and checks them after, as after a NIXL READ."""
    checked_read_part_bytes: int = Field(default=0, ge=0, le=1 << 40)
    """Such a read into a GPU pool is made in parts of about this many bytes, each part's checked pages
    copied to the GPU while the next part is read; a read of at most this many bytes, or 0 here (the
    default): one part, copied once it has all landed. 134217728 (128 MiB) is the size measured against
    one part (`cases.sh partab`)."""


class PeerServiceConfig(ServiceConfig):
    """Settings of a prefill, decode or unified service."""

    engine: EngineSection = EngineSection()
    peer: PeerSection = PeerSection()
    handoff: HandoffSection = HandoffSection()
    pagestore: PageStoreSection = PageStoreSection()
    sglang: SglangSection = SglangSection()
