"""How the stream and the evaluators reach Kafka: the cluster's address and security, and
the topics. Built once by the composition root (``probewire.deploy.settings``) and handed
to the components; the SASL password is read from its environment variable, never stored.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import check

__all__ = ["KafkaConfig", "TopicConfig", "broker_credentials"]


@dataclass(kw_only=True, slots=True)
class KafkaConfig:
    """How to reach the Kafka cluster (Tansu locally, an existing cluster in production)."""

    bootstrap: str = "127.0.0.1:9092"
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str = ""
    sasl_username: str = ""
    sasl_password_env: str = "PROBEWIRE_KAFKA_SASL_PASSWORD"
    ssl_ca_location: str = ""

    def __post_init__(self) -> None:
        check(bool(self.bootstrap.strip()), "bootstrap", "must not be empty")
        protocols = {"PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"}
        check(
            self.security_protocol in protocols,
            "security_protocol",
            f"must be one of {sorted(protocols)}, got {self.security_protocol!r}",
        )
        if self.security_protocol.startswith("SASL"):
            mechanisms = {"PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"}
            check(
                self.sasl_mechanism in mechanisms,
                "sasl_mechanism",
                f"must be one of {sorted(mechanisms)} with SASL, got {self.sasl_mechanism!r}",
            )

    def sasl_password(self) -> str:
        """The SASL password, from the environment variable ``sasl_password_env``; a
        ConfigError naming the variable when it is unset or empty."""
        password = os.environ.get(self.sasl_password_env, "")
        check(
            bool(password),
            "kafka.sasl_password_env",
            f"SASL needs the password in the environment variable {self.sasl_password_env}",
        )
        return password

    def client_config(self) -> dict[str, str]:
        """librdkafka (confluent-kafka) settings; the SASL password is read from its env var."""
        config = {"bootstrap.servers": self.bootstrap, "security.protocol": self.security_protocol}
        if self.security_protocol.startswith("SASL"):
            config["sasl.mechanism"] = self.sasl_mechanism
            config["sasl.username"] = self.sasl_username
            config["sasl.password"] = self.sasl_password()
        if self.ssl_ca_location:
            config["ssl.ca.location"] = self.ssl_ca_location
        return config


@dataclass(kw_only=True, slots=True)
class TopicConfig:
    """Topic names and their partition counts (created explicitly before use)."""

    metrics: str = "otlp_metrics"
    steps: str = "probewire.steps"
    control: str = "probewire.control"
    checkpoints: str = "probewire.checkpoints"
    evals: str = "probewire.evals"
    alerts: str = "probewire.alerts"
    deadletter: str = "probewire.deadletter"
    runs: str = "probewire.runs"
    """Run lifecycle events of the ranks (started with the run's config, finished, crashed)."""
    partitions: int = 4

    def __post_init__(self) -> None:
        check(self.partitions >= 1, "partitions", "must be >= 1")

    def all(self) -> dict[str, int]:
        """Every topic with its partition count; per-run topics use one partition per run key."""
        names = [
            self.metrics,
            self.steps,
            self.control,
            self.checkpoints,
            self.evals,
            self.alerts,
            self.deadletter,
            self.runs,
        ]
        return {name: self.partitions for name in names}


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
