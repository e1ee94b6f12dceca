"""Conntrack sysctls of a network namespace (read and written from a thread inside it).

/proc/sys/net follows the reading thread's network namespace, so `run_in_netns` is enough;
no `ip netns exec` subprocess is needed.
"""

from __future__ import annotations

from flow_exporter.conntrack.netns import run_in_netns

__all__ = ["ACCT", "TIMESTAMP", "enable_accounting", "read_sysctl", "write_sysctl"]

ACCT = "net.netfilter.nf_conntrack_acct"
TIMESTAMP = "net.netfilter.nf_conntrack_timestamp"

# What a record loses when the setting stays off.
_EFFECTS = {
    ACCT: "packet and byte counters will be 0",
    TIMESTAMP: "flow start/end times will fall back to the exporter's clock",
}


def _path(name: str) -> str:
    return "/proc/sys/" + name.replace(".", "/")


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def read_sysctl(name: str, netns: str | None = None) -> str:
    """Value of sysctl `name` (dotted) in `netns` (None: this process' namespace)."""
    path = _path(name)
    return run_in_netns(netns, lambda: _read(path))


def write_sysctl(name: str, value: str, netns: str | None = None) -> None:
    path = _path(name)

    def write() -> None:
        with open(path, "w") as f:
            f.write(value + "\n")

    run_in_netns(netns, write)


def enable_accounting(netns: str | None = None) -> list[str]:
    """Turns on nf_conntrack_acct and nf_conntrack_timestamp in `netns`.

    Returns one warning per setting left off, saying which record fields suffer; empty
    when both are on. Never raises for OS errors and does not log (the caller logs once).
    Both are per-netns settings; entries created before they were turned on keep lacking
    counters/timestamps.
    """
    where = f" in netns {netns}" if netns else ""
    warnings = []
    for name, effect in _EFFECTS.items():
        path = _path(name)

        def enable(path: str = path) -> str:
            if _read(path) != "1":
                with open(path, "w") as f:
                    f.write("1\n")
            return _read(path)

        try:
            value = run_in_netns(netns, enable)
        except OSError as e:
            warnings.append(f"could not set {name}=1{where} ({e.strerror or e}): {effect}")
            continue
        if value != "1":
            warnings.append(f"{name}{where} reads {value!r} after writing 1: {effect}")
    return warnings
