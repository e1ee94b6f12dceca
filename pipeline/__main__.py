"""``python -m pipeline`` is the same as ``flow-exporter``."""

import sys

from pipeline.cli import main

sys.exit(main())
