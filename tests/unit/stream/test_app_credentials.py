"""The Faust worker reaches the same cluster, with the same security, as the confluent
clients: ``broker_credentials`` against ``KafkaSettings.client_config`` per protocol; and
fetches without the client-side CRC check."""

from __future__ import annotations

import certifi
import pytest
from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

from probewire.deploy.settings import KafkaSettings, Settings, SettingsError
from probewire.stream.app import create_app
from probewire.stream.kafka import broker_credentials

ENV = "PROBEWIRE_TEST_SASL_PASSWORD"


@pytest.mark.parametrize(
    "protocol, mechanism",
    [("SASL_PLAINTEXT", "PLAIN"), ("SASL_SSL", "SCRAM-SHA-256"), ("SASL_SSL", "SCRAM-SHA-512")],
)
def test_sasl_matches_the_librdkafka_config(monkeypatch, protocol, mechanism):
    monkeypatch.setenv(ENV, "s3cret")
    kafka = KafkaSettings(
        security_protocol=protocol,
        sasl_mechanism=mechanism,
        sasl_username="probe",
        sasl_password_env=ENV,
        ssl_ca_location=certifi.where(),
    )
    auth = credentials_to_aiokafka_auth(broker_credentials(kafka))
    rdkafka = kafka.client_config()
    assert (
        auth["security_protocol"],
        auth["sasl_mechanism"],
        auth["sasl_plain_username"],
        auth["sasl_plain_password"],
    ) == (
        rdkafka["security.protocol"],
        rdkafka["sasl.mechanism"],
        rdkafka["sasl.username"],
        "s3cret",
    )
    assert (auth["ssl_context"] is not None) == (protocol == "SASL_SSL")
    if protocol == "SASL_SSL":  # the CA bundle of ssl_ca_location is loaded
        assert auth["ssl_context"].cert_store_stats()["x509_ca"] > 0


def test_tls_only_and_plaintext():
    auth = credentials_to_aiokafka_auth(
        broker_credentials(KafkaSettings(security_protocol="SSL", ssl_ca_location=certifi.where()))
    )
    assert auth["security_protocol"] == "SSL"
    assert auth["ssl_context"].cert_store_stats()["x509_ca"] > 0
    assert broker_credentials(KafkaSettings()) is None


def test_a_missing_sasl_password_is_a_settings_error_naming_the_variable(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    kafka = KafkaSettings(
        security_protocol="SASL_SSL",
        sasl_mechanism="PLAIN",
        sasl_username="probe",
        sasl_password_env=ENV,
    )
    for build in (lambda: broker_credentials(kafka), kafka.client_config):
        with pytest.raises(SettingsError, match=ENV):
            build()


def test_the_worker_app_carries_the_credentials(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV, "s3cret")
    settings = Settings(
        kafka=KafkaSettings(
            security_protocol="SASL_PLAINTEXT",
            sasl_mechanism="PLAIN",
            sasl_username="probe",
            sasl_password_env=ENV,
        )
    )
    app = create_app(
        settings.stream,
        settings.kafka,
        settings.topics,
        lambda: None,
        tmp_path / "worker.heartbeat",
    )
    auth = credentials_to_aiokafka_auth(app.conf.broker_credentials)
    assert (auth["security_protocol"], auth["sasl_plain_username"]) == ("SASL_PLAINTEXT", "probe")


def test_the_worker_app_fetches_without_checking_crcs(tmp_path):
    """aiokafka's CRC32C of each fetched batch runs in the consumer thread with the GIL held
    (~0.2 s for a 2,048-rank scan step's detail): the worker leaves it to the broker and
    TCP, as librdkafka does by default."""
    settings = Settings()
    app = create_app(
        settings.stream, settings.kafka, settings.topics, lambda: None, tmp_path / "w.heartbeat"
    )
    assert app.conf.broker_check_crcs is False
