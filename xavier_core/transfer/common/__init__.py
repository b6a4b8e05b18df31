"""The shared types of the data plane: what every other room of `xavier_core.transfer` speaks in.

- `buffers`: `KvBuffer`, one registered buffer (address, length, bytes per page, device string).
- `runs`: `PageRun`s (coalesced page ids) and their pairing into transfer descriptors (`descriptors`,
  `pair_stretches`, the `Mode` of a read).
- `peers`: `peer_key` / `split_peer_key`, one epoch of one peer, the unit remote metadata is cached under.
- `source`: `SourceInfo`, what a source publishes so a reader can pull, and its wire form (the contract's
  `SourceDescriptor` and `TransferEndpoint`, validated here since they arrive from the network).
- `slab_layout`: `SlabLayout`, how a staging slab is cut (a source's endpoint names its slab).
- `host`: `boot_id`, which host (since which boot) a process runs on, for same-host shortcuts.
- `errors`: the typed errors (`TransferError` and its kinds) that the services map to gRPC statuses.

Nothing here imports NIXL, CUDA or another room of the package (`source` alone loads the protos);
importing `buffers` alone, as the engine does, loads only the standard library.
"""
