"""Running commands for the lab: on the host, inside a network namespace, and setting sysctls.

Everything the lab does to the kernel goes through ``ip``, ``nft``, ``conntrack`` and ``sysctl``;
these helpers turn a failed command into a ``LabError`` carrying its stderr.
"""

from __future__ import annotations

import subprocess

from devtools.lab.model import LabError, Pod

__all__ = ["LabError", "run", "run_in"]


def run(
    *cmd: str, input: str | None = None, check: bool = True, timeout: float = 120.0
) -> subprocess.CompletedProcess[str]:
    """Run a command, raising LabError with its stderr so failures are readable in tests."""
    try:
        proc = subprocess.run(
            list(cmd), input=input, capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LabError(f"{' '.join(cmd)}: {exc}") from exc
    if check and proc.returncode != 0:
        raise LabError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


def run_in(
    netns: str | Pod, *cmd: str, input: str | None = None, check: bool = True, timeout: float = 120.0
) -> subprocess.CompletedProcess[str]:
    """Run a command inside a network namespace (``ip netns exec``)."""
    ns = netns.netns if isinstance(netns, Pod) else netns
    return run("ip", "netns", "exec", ns, *cmd, input=input, check=check, timeout=timeout)


def _sysctl_w(netns: str, settings: dict[str, str | int]) -> None:
    """Set sysctls inside a namespace and read them back, because many are per netns."""
    args = [f"{k}={v}" for k, v in settings.items()]
    run_in(netns, "sysctl", "-q", "-w", *args)
    got = run_in(netns, "sysctl", "-n", *settings).stdout.split()
    want = [str(v) for v in settings.values()]
    if got != want:
        raise LabError(f"sysctls in {netns} did not stick: wanted {want}, read {got}")
