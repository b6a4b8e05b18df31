"""The CUDA copy and IPC: KV pages moved between two GPUs of one host without NIXL.

- `copy_plan`: `PoolView` (a pool's bases and bytes per page on one device) and the fused kernel's
  arguments, prepared with numpy alone so CPU-only CI checks them.
- `copy`: the fused Triton page-copy kernel (a torch path without Triton), its copy stream and the
  `CopyHandle` whose CUDA event says when a copy is done.
- `ipc`: `export_pool` / `IpcImporter`, this process's pool as IPC handles and a peer's pool mapped
  once per epoch.
- `_driver`: the few CUDA driver calls torch does not expose (legacy IPC handles, peer access).

Uses `common` only; torch and Triton load when a copy is first made.
"""
