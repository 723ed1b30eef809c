"""Faust's credentials for the Kafka cluster; the connection and topics themselves
(``KafkaConfig``, ``TopicConfig``) are shared with the evaluators in
``probewire.instrument.plumbing``."""

from __future__ import annotations

from probewire.instrument.plumbing import KafkaConfig

__all__ = ["broker_credentials"]


def broker_credentials(kafka: KafkaConfig):
    """Faust's (aiokafka's) credentials for the cluster the confluent clients reach with
    ``kafka.client_config()``: TLS with the CA of ``ssl_ca_location`` (system CAs when
    empty), SASL PLAIN / SCRAM with the password from its environment variable."""
    import faust
    from aiokafka.helpers import create_ssl_context

    ssl_context = None
    if kafka.security_protocol in ("SSL", "SASL_SSL"):
        ssl_context = create_ssl_context(cafile=kafka.ssl_ca_location or None)
    if kafka.security_protocol.startswith("SASL"):
        return faust.SASLCredentials(
            username=kafka.sasl_username,
            password=kafka.sasl_password(),
            mechanism=kafka.sasl_mechanism,
            ssl_context=ssl_context,
        )
    return faust.SSLCredentials(ssl_context) if ssl_context is not None else None
