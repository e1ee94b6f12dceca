"""Where records go: the Kafka producer (the Sink port), the record encoder, Schema Registry framing."""

from flow_exporter.sink.kafka import KafkaSink, Route, SinkError

__all__ = ["KafkaSink", "Route", "SinkError"]
