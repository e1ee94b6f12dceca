"""Where records go: the Kafka producer (the Sink port), the record encoder, Schema Registry framing."""

from flow_exporter.settings import Route  # a kafka.routes entry: the sink sends by the first that matches
from flow_exporter.sink.kafka import KafkaSink, SinkError

__all__ = ["KafkaSink", "Route", "SinkError"]
