"""docs/compatibility.md's table of pinned versions is the one the repository's pins give now.

The rows come from the pins themselves (devtools/compatibility.py reads the locks, go.mod files, build scripts and
poms); a pin that moves without ``python -m devtools.compatibility --write`` leaves the page behind and fails here.
The machine's rows (kernel, Python, podman) are what the machine had when the page was written: only their
presence is checked.
"""

from __future__ import annotations

from devtools import compatibility


def page_block() -> str:
    text = compatibility.PAGE.read_text()
    start, end = text.index(compatibility.BEGIN), text.index(compatibility.END)
    return text[start:end]


def test_pinned_table_is_current() -> None:
    assert compatibility.table(compatibility.pinned_rows()) in page_block(), (
        "docs/compatibility.md is behind the pins: .venv/bin/python -m devtools.compatibility --write"
    )


def test_machine_rows_are_there() -> None:
    """(Read without running them: machine_rows() starts a container.)"""
    block = page_block()
    components = ("Linux kernel", "Kernel options", "Kernel features exercised", "Python (tests)", "podman")
    for component in (*components, "Python (image tests)"):
        assert f"| {component} | " in block, component


def test_pins_are_read_from_their_files() -> None:
    """A few rows against the files by hand: the table says what the files say."""
    rows = {r.component: r.tested for r in compatibility.pinned_rows()}
    kafka = compatibility.REPO / "devtools" / "kafka.py"
    assert rows["Kafka broker"].startswith(kafka.read_text().split('KAFKA_VERSION = "')[1].split('"')[0] + " ")
    go_mod = (compatibility.REPO / "tools" / "k8s" / "apiserver" / "go.mod").read_text()
    assert f"k8s.io/kubernetes v{rows['Kubernetes API server']} " in go_mod
    assert f"build helm {rows['Helm']} " in (compatibility.REPO / "tools" / "k8s" / "tools.sh").read_text()
