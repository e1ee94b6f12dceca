"""flow-exporter: Linux conntrack connections as Kubernetes-enriched Avro flow records in Kafka."""

__version__ = "0.1.0"
