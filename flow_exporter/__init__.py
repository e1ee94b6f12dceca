"""flow-exporter: Linux conntrack connections as Kubernetes-enriched Avro flow records in Kafka."""

from flow_exporter import compiled as _compiled  # noqa: F401  (the build of the hot modules is chosen here, once)

try:  # written by the build from the git tag (pyproject.toml [tool.setuptools_scm]); not in git
    from flow_exporter._version import __version__ as __version__  # type: ignore[import-not-found,unused-ignore]
except ImportError:  # a source tree that no build or install has seen
    __version__ = "0+unknown"
