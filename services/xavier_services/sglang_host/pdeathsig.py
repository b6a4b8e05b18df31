"""`python -m xavier_services.sglang_host.pdeathsig PARENT_PID -- PROGRAM ARGS...`: exec PROGRAM so that it
gets SIGKILL when the hosting service dies, even by SIGKILL (Linux `PR_SET_PDEATHSIG`, kept across exec).

A `preexec_fn` would do the same inside the fork, but is unsafe in a process with threads (gRPC's); this
wrapper runs in the child after the fork instead. SGLang's own subprocesses set the same signal on
themselves, so the whole tree goes.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: pdeathsig PARENT_PID -- PROGRAM [ARGS...]", file=sys.stderr)
        return 2
    parent = int(argv[0])
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            print(f"prctl(PR_SET_PDEATHSIG) failed: errno {ctypes.get_errno()}", file=sys.stderr)
            return 1
    if os.getppid() != parent:
        return 1  # the parent died before the signal was armed: nobody would stop this child
    os.execvp(argv[2], argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
