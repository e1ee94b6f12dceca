"""``flow-exporter`` command line: ``run``, ``config``, ``tail``, ``schema``.

Exit codes: 0 done, 1 runtime failure (message logged), 2 bad configuration or usage.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from flow_exporter import __version__, commands
from flow_exporter.config import ConfigError, Settings, add_flags, from_flags
from flow_exporter.settings import defaults_text

log = logging.getLogger("flow_exporter")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flow-exporter",
        description="Export Linux conntrack connections as Avro flow records to Kafka.",
    )
    p.add_argument("--version", action="version", version=f"flow-exporter {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser("run", help="run the exporter (the DaemonSet entry point)")
    add_flags(run)

    cfg = sub.add_parser("config", help="show settings")
    add_flags(cfg)
    g = cfg.add_mutually_exclusive_group()
    g.add_argument("--print-defaults", action="store_true", help="every setting, its default and meaning")
    g.add_argument("--print", action="store_true", help="the effective settings as JSON")

    commands.add_parsers(sub)  # tail, schema
    return p


def _load_config(args: argparse.Namespace) -> Settings:
    """The settings, with librdkafka's judgement of ``kafka.producer`` (a bad one exits 2 before anything starts)."""
    from flow_exporter.sink.kafka import check_config

    return from_flags(args, checks=(check_config,))


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S%z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("kubernetes").setLevel(max(logging.WARNING, root.level))


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command is None:
        _parser().print_help()
        return 2
    if args.command in commands.COMMANDS:
        return commands.run(args)
    try:
        settings = _load_config(args)
    except ConfigError as exc:
        print(f"flow-exporter: {exc}", file=sys.stderr)
        return 2
    if args.command == "config":
        if args.print:  # the settings as run would take them: its checks too
            from flow_exporter.runner import preflight

            try:
                preflight(settings)
            except ConfigError as exc:
                print(f"flow-exporter: {exc}", file=sys.stderr)
                return 2
        try:
            if args.print:
                print(json.dumps(settings.masked(), indent=2, default=str), flush=True)
            else:
                print(defaults_text(), end="", flush=True)
        except BrokenPipeError:
            # The reader went away (``| head``): stop quietly, and keep Python's exit flush quiet too.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    setup_logging(settings.log.level, settings.log.format)
    from flow_exporter.runner import run_exporter

    return run_exporter(settings, install_signals=_install_signals)


def _install_signals(stop: Any) -> None:
    def handler(signum: int, _frame: object) -> None:
        log.info("received %s: stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


if __name__ == "__main__":
    sys.exit(main())
