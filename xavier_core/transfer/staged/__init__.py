"""The staged path: a room's scattered pages cross hosts as a few whole chunks of a registered slab.

- `slab`: the protocol (read its docstring first), `Slab` (a slab's memory and its chunk allocator),
  `View`, and the gather and scatter copies (numpy on DRAM, the fused kernel of `cuda.copy` on VRAM).
- `port_slab`: `PortSlab`, one port's slab as a source uses it: which rooms hold which chunks, when a
  room is staged at all, its counters.
- `read`: `StagedRead`, the reader's side: one pull as a state machine that the port's NIXL thread
  steps between its polls, a ring of chunks READ and scattered in turn.

How a slab is cut (`SlabLayout`) is in `common.slab_layout`, since a source's endpoint carries it.
Uses `common`, `nixl` and (for VRAM copies) `cuda`.
"""
