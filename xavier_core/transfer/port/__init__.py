"""The port and its reads: the data plane as a service drives it, over every transport.

- `kv_port`: `KvPort`, the asyncio face: publish a room's pages as a `SourceDescriptor`, pull a peer's
  into reserved pages, unpublish, hear how a source's read ended (`ReadEnd`); its stats and
  `TransferTotals`. Read this first.
- `core`: `PortCore`, the machinery under it: the one NIXL thread, the live work that thread polls, and
  the hand-off of what ended to the asyncio loop.
- `pulls`: how a reader pulls a room over each transport (NIXL page runs, a CUDA IPC copy, staged chunks),
  keeping I1 when a pull is cancelled or times out.
- `transport`: which transport a pull takes, the CUDA IPC pull itself (`IpcPeers`) and the run lengths
  pulls are counted by.
- `metrics`: the Prometheus view of a port, read from its stats at scrape time.

The top floor of the package: uses `common`, `nixl`, `cuda` and `staged`; nothing below imports it.
"""
