"""flow-exporter: Linux conntrack connections as Kubernetes-enriched Avro flow records in Kafka."""

from flow_exporter import compiled as _compiled  # noqa: F401  (the build of the hot modules is chosen here, once)

__version__ = "0.1.0"
