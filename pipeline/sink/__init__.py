"""Where records go: Avro serialization and the Kafka producer."""

from pipeline.sink.avro import AvroSerializer
from pipeline.sink.kafka import DeliveryReport, KafkaSink, Route, SinkError

__all__ = ["AvroSerializer", "DeliveryReport", "KafkaSink", "Route", "SinkError"]
