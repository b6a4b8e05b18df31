"""The NIXL agent and what runs on it: registered buffers, peers, posted READs and per-room state.

- `_raw`: the typed boundary over NIXL's untyped Python API (`RawAgent`, memory types, transfer states);
  the only module that loads a NIXL build.
- `agent`: `NixlAgent`, one per process: registers KV buffers, caches peers by `peer_key` (older epochs
  dropped), turns page runs into descriptor lists and posts READs.
- `prepped`: prepared descriptor lists (every page of every buffer of the local pool once, of a peer's
  once per epoch), so a coalesced READ or WRITE names its pages by index instead of building lists.
- `xfer`: `Transfer`, one posted READ: polled to completion, released exactly once, cancelled past its
  timeout.
- `rooms`: `KvManager` / `KvSender` / `KvReceiver`, the per-room state machines (SGLang's `KVPoll`
  states) driven by polling, and the notifications a reader sends when it is done or failed.
- `thread`: `NixlThread`, the one thread all of a process's NIXL calls run on.

Uses `common` only.
"""
