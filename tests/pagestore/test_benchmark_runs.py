"""`benchmarks/pagestore.py` runs end to end on a CPU box, its unchecked get included: the GPU hosts run
it as is (`scripts/gpu/cases.sh`), and a name it patches that the code no longer has fails there, not
here, unless this runs it (the GB/s points with and without the check, the same-host read into a pool
staged through host memory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gbps_points_run_with_and_without_their_check(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "pagestore.py"), "--ttft-reps", "0", "--stage-host-pool",
           "--read-path", "direct", "--layers", "2", "--segment-bytes", "4096", "--pages", "8",
           "--run-lengths", "8", "--reps", "1", "--out-dir", str(tmp_path), "--tag", "smoke"]  # fmt: skip
    # the benchmark imports the suite's process helpers (`tests.support`): the project's root on the path
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    (point,) = json.loads((tmp_path / "pagestore-smoke.json").read_text())["points"]
    assert point["pages"] == 8 and point["read_path"] == "direct" and point["direct_reads"] > 0
    assert point["get_ms"] > 0 and point["get_unverified_ms"] > 0
