"""The churn generator (``bench/churn.c``), compiled into ``.cache/bench/churn`` when missing or older than its source.

Short UDP request/response flows at a fixed rate, one conntrack entry each, with sizes that follow from the
ports (the source says how): bench/bench_events.py loads the exporter with it, and the sampling lab test
(tests/integration/test_sampling_lab.py) makes thousands of connections with it in seconds.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build_churn() -> Path:
    out = ROOT / ".cache" / "bench" / "churn"
    src = ROOT / "bench" / "churn.c"
    if not out.exists() or out.stat().st_mtime < src.stat().st_mtime:
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["gcc", "-O2", "-Wall", "-o", str(out), str(src)], check=True)
    return out
