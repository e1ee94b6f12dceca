"""Where records go: Avro serialization and the Kafka producer."""

from flow_exporter.sink.avro import AvroSerializer
from flow_exporter.sink.kafka import DeliveryReport, KafkaSink, Route, SinkError

__all__ = ["AvroSerializer", "DeliveryReport", "KafkaSink", "Route", "SinkError"]
