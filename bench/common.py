"""Shared benchmark plumbing: medians, machine description, JSON + PNG output, the performance page's sections.

Each benchmark writes ``docs/performance/<name>.json`` and ``<name>.png`` and replaces
its own section of docs/performance.md (between ``<!-- bench:<name> -->`` markers), so
re-running one benchmark never disturbs the others' results.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "performance"
BENCHMARKS_MD = ROOT / "docs" / "performance.md"


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "memory_gib": round(mem_gib, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def machine_line() -> str:
    m = machine()
    return f"{m['cores']} cores ({m['cpu']}), {m['memory_gib']} GiB, Linux {m['kernel']}, Python {m['python']}"


def median_time(fn: Callable[[], object], repeat: int = 5, warmup: int = 1) -> tuple[float, list[float]]:
    """Median wall seconds of ``fn`` over ``repeat`` runs (after ``warmup`` untimed runs)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def time_command(cmd: str, repeat: int = 5) -> tuple[float, list[float]]:
    """Median wall seconds of a shell command (e.g. ``conntrack -L > /dev/null``)."""

    def run() -> None:
        subprocess.run(cmd, shell=True, check=True, stderr=subprocess.DEVNULL)

    return median_time(run, repeat=repeat)


def write_json(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {"benchmark": name, "machine": machine(), "command": command_line(), **data}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def command_line() -> str:
    return (
        "python -m bench " + " ".join(sys.argv[1:])
        if sys.argv[0].endswith("__main__.py")
        else ("python " + " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]))
    )


def section_head(title: str, module: str, argv: list[str] | None) -> list[str]:
    """A docs/performance.md section's first lines: its title, the exact command and the machine."""
    cmd = " ".join([f"python -m {module}", *(argv if argv is not None else sys.argv[1:])])
    return [f"## {title}", "", f"Command: `{cmd}`  ", f"Machine: {machine_line()}", ""]


def plot_load(name: str, cpu_cores: float, records_per_s: float, title: str) -> None:
    """CPU in cores beside the record rate as a share of 50,000/s, against the one-core line."""

    def draw(ax: Any) -> None:
        ax.bar(["CPU (cores)", "records/s / 50k"], [cpu_cores, records_per_s / 50_000], color=["#1f77b4", "#ff7f0e"])
        ax.axhline(1.0, color="grey", linestyle="--")
        ax.set_title(title)

    plot(name, draw)


def update_section(name: str, markdown: str) -> None:
    """Replace (or append) this benchmark's section of docs/performance.md."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    text = BENCHMARKS_MD.read_text() if BENCHMARKS_MD.exists() else "# Benchmarks\n\n"
    block = f"{start}\n{markdown.rstrip()}\n{end}"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _m: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    BENCHMARKS_MD.write_text(text)


def plot(name: str, draw: Callable[[Any], None]) -> Path | None:
    """Render a PNG with matplotlib (headless); None if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    draw(ax)
    fig.tight_layout()
    path = RESULTS / f"{name}.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def tcp_conn(i: int, src: bytes, dst: bytes, sport: int, packets: int, *, orig_dst: bytes | None = None,
             dport: int = 8080, start_ns: int = 0) -> Any:  # fmt: skip
    """An ESTABLISHED TCP conntrack entry (``flow_exporter.connection.Connection``) with conntrack id ``i + 1``.

    ``packets`` each way; 1,500-byte packets out, 900-byte packets back.
    """
    import socket

    from flow_exporter.connection import PROTO_TCP, Connection

    return Connection(
        family=socket.AF_INET,
        proto=PROTO_TCP,
        orig_src=src,
        orig_dst=orig_dst or dst,
        orig_sport=sport,
        orig_dport=80 if orig_dst else dport,
        reply_src=dst,
        reply_dst=src,
        reply_sport=dport,
        reply_dport=sport,
        ct_id=i + 1,
        tcp_state=3,
        orig_packets=packets,
        orig_bytes=1500 * packets,
        reply_packets=packets,
        reply_bytes=900 * packets,
        start_ns=start_ns,
        status=0x18E,
    )
