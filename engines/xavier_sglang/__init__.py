"""Xavier inside SGLang: the `xavier` disaggregation transfer backend and a HiCache storage backend.

SGLang loads `xavier_sglang.plugin:register` through its plugin entry point (group `sglang.srt.plugins`,
allow-listed with `SGLANG_PLUGINS=xavier`). Nothing here imports SGLang at import time: `config`,
`hub`, `loop`, `rooms` and `reader` are plain Xavier code (set-up checks, the room state machines over
`xavier_core.transfer` and the directory client), and only `manager`, `conn` (the classes SGLang
instantiates) and `hicache` subclass SGLang's bases, so they are imported by SGLang itself, from inside
a process that has it. docs/sglang.md describes the
deployment.
"""
