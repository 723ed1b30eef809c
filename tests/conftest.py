"""Shared fixtures: the real broker and the real ClickHouse engine.

Where they come from, in order:
1. ``KAFKA_BOOTSTRAP`` / ``CLICKHOUSE_URL`` set: the servers they name;
2. a reachable Docker engine (and ``testcontainers`` installed): Kafka and ClickHouse
   containers;
3. otherwise the local engines of DESIGN.md: Tansu as a subprocess and chdb in-process.

chdb opens one data directory per process for the whole process lifetime, so the test
process owns exactly one store (session scope); each test gets its own database in it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from probewire.deploy.settings import Settings
from probewire.deploy.stack import LocalStack


def _docker_reachable() -> bool:
    if not shutil.which("docker"):
        return False
    try:
        import testcontainers  # noqa: F401
    except ImportError:
        return False
    probe = subprocess.run(["docker", "info"], capture_output=True, timeout=10)
    return probe.returncode == 0


@pytest.fixture(scope="session")
def engines() -> str:
    """Which engines this session uses: "external", "docker" or "local"."""
    if os.environ.get("KAFKA_BOOTSTRAP") or os.environ.get("CLICKHOUSE_URL"):
        return "external"
    return "docker" if _docker_reachable() else "local"


@pytest.fixture(scope="session")
def kafka_bootstrap(engines: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Kafka bootstrap address for the whole session."""
    if os.environ.get("KAFKA_BOOTSTRAP"):
        yield os.environ["KAFKA_BOOTSTRAP"]
        return
    if engines == "docker":
        from testcontainers.kafka import KafkaContainer

        with KafkaContainer() as kafka:
            yield kafka.get_bootstrap_server()
        return
    stack = LocalStack(Settings(), tmp_path_factory.mktemp("broker"))
    try:
        yield stack.start_broker()
    finally:
        stack.stop()


@pytest.fixture(scope="session")
def store_url(engines: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The ClickHouse address this test process writes to."""
    if os.environ.get("CLICKHOUSE_URL"):
        yield os.environ["CLICKHOUSE_URL"]
        return
    if engines == "docker":
        from testcontainers.clickhouse import ClickHouseContainer

        with ClickHouseContainer() as ch:
            host, port = ch.get_container_host_ip(), ch.get_exposed_port(8123)
            yield f"http://{ch.username}:{ch.password}@{host}:{port}"
        return
    path = tmp_path_factory.mktemp("chdb-store")
    yield "chdb:///" + str(path).lstrip("/")


@pytest.fixture(scope="session")
def ch_client(store_url: str):
    from probewire.sinks.clickhouse import connect

    return connect(store_url)


@pytest.fixture()
def ch_database(ch_client) -> Iterator[str]:
    """A fresh database name for one test, dropped afterwards."""
    name = f"pw_test_{uuid.uuid4().hex[:10]}"
    yield name
    ch_client.command(f"DROP DATABASE IF EXISTS {name}")


def _query_store(store: Path, sql: str) -> list[dict]:
    """Read a chdb store that another process wrote, from a fresh process (chdb: one
    data directory per process), as a list of row dicts."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "probewire.deploy.cli",
            "sql",
            "--store",
            str(store),
            "--format",
            "json",
            sql,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if out.returncode != 0:
        raise AssertionError(f"probewire sql failed ({out.returncode}): {out.stderr}")
    import json

    return json.loads(out.stdout)


@pytest.fixture(scope="session")
def read_store():
    """``read_store(store_dir, sql) -> list[dict]``: query a store another process wrote."""
    return _query_store


@pytest.fixture()
def scratch_dir() -> Iterator[Path]:
    """A temporary directory outside pytest's tmp tree (short paths for sockets and logs)."""
    path = Path(tempfile.mkdtemp(prefix="pw-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
