"""Command line: ``python -m devtools.lab up|cleanup|agent``.

``up`` keeps a lab until Ctrl-C, ``cleanup PREFIX`` removes a leftover lab's namespaces and
``agent`` (internal) runs the traffic agent in the current namespace.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import re
import signal
import sys
import time

from devtools.lab.agent import _AgentMain
from devtools.lab.shell import run
from devtools.lab.topology import Lab


def _cleanup(prefix: str) -> list[str]:
    """Delete namespaces that look like they belong to lab ``prefix``."""
    pat = re.compile(rf"^{re.escape(prefix)}-(node|tbl|p\d+)$")
    names = [ln.split()[0] for ln in run("ip", "netns", "list").stdout.splitlines() if ln.strip()]
    gone = [n for n in names if pat.match(n)]
    for n in gone:
        run("ip", "netns", "del", n, check=False)
    return gone


def main(argv: list[str] | None = None) -> int:
    """``agent`` (internal), ``up`` (hold a lab until Ctrl-C), ``cleanup PREFIX``."""
    ap = argparse.ArgumentParser(prog="python -m devtools.lab")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("agent", help="internal: run the traffic agent in the current netns")
    up = sub.add_parser("up", help="create a lab and keep it until interrupted")
    up.add_argument("--name")
    up.add_argument("--pods", type=int, default=3)
    cl = sub.add_parser("cleanup", help="delete a leftover lab's namespaces")
    cl.add_argument("prefix")
    args = ap.parse_args(argv)
    if args.cmd == "agent":
        _AgentMain().main()
        return 0
    if args.cmd == "cleanup":
        print("\n".join(_cleanup(args.prefix)) or "nothing to delete")
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with Lab(args.name, args.pods) as lab:
        info = {
            "name": lab.name,
            "node": lab.node_ns,
            "pods": [dataclasses.asdict(p) for p in lab.pods],
            "setup_seconds": round(lab.setup_seconds, 3),
        }
        print(json.dumps(info, indent=2), flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
