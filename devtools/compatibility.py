"""The compatibility table (docs/compatibility.md): what this version was tested against, read, never typed in.

``python -m devtools.compatibility`` prints the table; ``--write`` puts it into docs/compatibility.md between its
markers. Two kinds of rows:

* pinned: a version the repository fixes (a lock, a go.mod, a build script, a pom, the chart), read from there.
  tests/unit/test_compatibility.py holds the page to these, so a changed pin without a rewritten page fails;
* machine: what the machine that ran the tests had (its kernel and the kernel's configuration, its Python, podman),
  read when the page was written, and said to be so.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "compatibility.md"
BEGIN = "<!-- begin: python -m devtools.compatibility --write -->"
END = "<!-- end: python -m devtools.compatibility --write -->"
# Kernel options the exporter's paths use: conntrack over netlink with events, zones, timestamps and labels; the
# bpf(2) syscall for Cilium's pinned maps.
KERNEL_OPTIONS = (
    "CONFIG_NF_CONNTRACK",
    "CONFIG_NF_CT_NETLINK",
    "CONFIG_NF_CONNTRACK_EVENTS",
    "CONFIG_NF_CONNTRACK_TIMESTAMP",
    "CONFIG_NF_CONNTRACK_ZONES",
    "CONFIG_NF_CONNTRACK_LABELS",
    "CONFIG_BPF_SYSCALL",
)


@dataclass(frozen=True)
class Row:
    component: str
    tested: str
    source: str  # where the version is set or read

    def line(self) -> str:
        return f"| {self.component} | {self.tested} | {self.source} |"


def _read(rel: str) -> str:
    return (REPO / rel).read_text()


def _match(rel: str, pattern: str) -> str:
    found = re.search(pattern, _read(rel), re.MULTILINE)
    if not found:
        raise SystemExit(f"compatibility: no match for {pattern!r} in {rel}")
    return found.group(1)


def _pin(lock: str, name: str) -> str:
    return _match(lock, rf"^{re.escape(name)}==(\S+)")


def pinned_rows() -> list[Row]:
    """The versions the repository fixes; the same on every machine."""
    project = tomllib.loads(_read("pyproject.toml"))["project"]
    kafka_client = _pin("requirements/runtime.lock", "confluent-kafka")
    librdkafka = _librdkafka(kafka_client)
    # Its module tags v0.3xx.y are the releases 3.xx.y (tools/prometheus/build.sh).
    prometheus = re.sub(
        r"^(\d)(\d+)\.(\d+)$", r"\1.\2.\3", _match("tools/prometheus/go.mod", r"prometheus/prometheus v0\.(\S+)")
    )
    cilium = [
        _match(f"tools/cilium/{d.name}/go.mod", r"github\.com/cilium/cilium (v\S+)")
        for d in sorted((REPO / "tools" / "cilium").iterdir())
        if (d / "go.mod").is_file()
    ]
    return [
        Row("Python (supported)", project["requires-python"], "pyproject.toml `requires-python`"),
        Row(
            "Kafka broker",
            _match("devtools/kafka.py", r'^KAFKA_VERSION = "(\S+)"')
            + " (KRaft; one broker, and a three-broker cluster)",
            "devtools/kafka.py `KAFKA_VERSION`",
        ),
        Row("confluent-kafka", kafka_client, "requirements/runtime.lock"),
        Row("librdkafka", f"{librdkafka} (in the confluent-kafka wheel)", "`confluent_kafka.libversion()`"),
        Row(
            "Kubernetes API server",
            _match("tools/k8s/apiserver/go.mod", r"k8s\.io/kubernetes v(\S+)"),
            "tools/k8s/apiserver/go.mod (tools/k8s/build.sh)",
        ),
        Row(
            "Kubernetes (chart's floor)",
            _match("charts/flow-exporter/Chart.yaml", r'^kubeVersion: "(.+)"'),
            "charts/flow-exporter/Chart.yaml `kubeVersion`",
        ),
        Row("Helm", _match("tools/k8s/tools.sh", r"^build helm (v\S+) "), "tools/k8s/tools.sh"),
        Row(
            "kustomize",
            _match("tools/k8s/tools.sh", r"^build kustomize (v\S+) "),
            "tools/k8s/tools.sh",
        ),
        Row(
            "Cilium (CT map layouts)",
            ", ".join(cilium),
            "tools/cilium/*/go.mod (maps written by Cilium's own code)",
        ),
        Row("Spark (PySpark)", _pin("requirements/dev.lock", "pyspark"), "requirements/dev.lock"),
        Row(
            "Flink (PyFlink)",
            f"{_pin('requirements/flink.lock', 'apache-flink')}; Kafka connector "
            f"{_match('tools/flink/pom.xml', r'<flink.kafka.connector.version>(.+)</')}, Avro registry format "
            f"{_match('tools/flink/pom.xml', r'<flink.avro.registry.version>(.+)</')}",
            "requirements/flink.lock, tools/flink/pom.xml",
        ),
        Row("Prometheus and promtool", prometheus, "tools/prometheus/go.mod"),
        Row("cosign (release signing)", _match("tools/cosign/build.sh", r"^version=(v\S+)$"), "tools/cosign/build.sh"),
    ]


def _librdkafka(client_version: str) -> str:
    """librdkafka as the locked confluent-kafka wheel bundles it (the installed one must be the lock's)."""
    import confluent_kafka

    installed = importlib.metadata.version("confluent-kafka")
    if installed != client_version:
        raise SystemExit(f"compatibility: confluent-kafka {installed} installed, the lock pins {client_version}")
    return str(confluent_kafka.libversion()[0])


def _kernel_options() -> str:
    try:
        with gzip.open("/proc/config.gz", "rt") as f:
            config = f.read()
    except OSError:
        return "configuration not readable here (/proc/config.gz)"
    found = []
    for option in KERNEL_OPTIONS:
        m = re.search(rf"^{option}=(\S+)", config, re.MULTILINE)
        found.append(f"{option}={m.group(1) if m else 'unset'}")
    return ", ".join(found)


def _command(argv: list[str]) -> str | None:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def _image_python() -> str:
    env = {**os.environ, "CONTAINERS_CONF": str(REPO / "tools" / "image" / "containers.conf")}
    base = _command(["bash", str(REPO / "tools" / "image" / "base.sh"), "--tag"])
    if not base:
        return "not measured"
    try:
        proc = subprocess.run(
            ["podman", "run", "--rm", "--runtime", "runc", "--network", "none", base, "python", "--version"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env=env,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "not measured"
    return proc.stdout.split()[-1] if proc.returncode == 0 and proc.stdout.strip() else "not measured"


def machine_rows() -> list[Row]:
    """What this machine has, read now."""
    podman = _command(["podman", "--version"]) or "not installed"
    return [
        Row("Linux kernel", platform.release(), "`uname -r` of the test machine"),
        Row("Kernel options", _kernel_options(), "/proc/config.gz of the test machine"),
        Row(
            "Kernel features exercised",
            "conntrack dumps and NEW/DESTROY events over ctnetlink; nf_conntrack_acct and nf_conntrack_timestamp "
            "(set to 1 in the tests' network namespaces); zones; Cilium's CT maps (BPF LRU hashes pinned in a "
            "bpffs, written by Cilium's own code, read with bpf(2))",
            "tests/integration",
        ),
        Row("Python (tests)", platform.python_version(), "the test machine's virtualenv"),
        Row("Python (image tests)", _image_python(), "Debian bookworm's python3.11 (tools/image/base.sh)"),
        Row("podman", podman.removeprefix("podman version "), "the test machine (Debian's package)"),
    ]


def table(rows: list[Row]) -> str:
    head = "| component | tested | where it is set or read |\n| --- | --- | --- |\n"
    return head + "".join(r.line() + "\n" for r in rows)


def block() -> str:
    pinned, machine = table(pinned_rows()), table(machine_rows())
    return (
        f"{BEGIN}\n\nPinned by the repository (tests/unit/test_compatibility.py holds this table to the pins):\n\n"
        f"{pinned}\nOn the machine the tests ran on when this page was written:\n\n{machine}\n{END}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite the table in {PAGE.relative_to(REPO)}")
    args = parser.parse_args()
    text = block()
    if not args.write:
        print(text)
        return 0
    page = PAGE.read_text()
    start, end = page.index(BEGIN), page.index(END) + len(END)
    PAGE.write_text(page[:start] + text + page[end:])
    print(f"wrote {PAGE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
