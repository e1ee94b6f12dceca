"""``python -m flow_exporter`` is the same as ``flow-exporter``."""

import sys

from flow_exporter.cli import main

sys.exit(main())
