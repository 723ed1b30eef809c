"""The Helm chart renders, lints and validates offline, and never carries a secret value.

Rendering and linting go through helm-python-sdk (Helm's Go SDK, no helm binary);
every rendered manifest is validated with kubernetes-validate against the newest
Kubernetes schema it bundles, in strict mode (unknown fields are errors).
"""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from probewire.deploy import settings as settings_module
from probewire.deploy.settings import load_settings

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "helm" / "probewire"
VALUES_DIR = Path(__file__).resolve().parent / "values"
RELEASE = "probewire"
NAMESPACE = "training-health"
KUBE_VERSION = kubernetes_validate.latest_version()
# Kinds that come from CRDs, for which kubernetes-validate has no schema.
CRD_KINDS = {"ServiceMonitor"}
SENTINEL = "SENTINEL-"
CASES = [
    "default",
    "sasl-kafka",
    "clickhouse-tls",
    "evaluator-off",
    "service-monitor",
    "grafana-datasource",
]

_BASE = {
    ("ConfigMap", "probewire-config"),
    ("ConfigMap", "probewire-migrate-config"),
    ("ConfigMap", "probewire-dashboards"),
    ("Deployment", "probewire-worker"),
    ("Deployment", "probewire-evaluator"),
    ("Job", "probewire-migrate"),
    ("PodDisruptionBudget", "probewire-worker"),
}
EXPECTED_OBJECTS = {
    "default": _BASE,
    "sasl-kafka": _BASE,
    "clickhouse-tls": _BASE,
    "evaluator-off": _BASE - {("Deployment", "probewire-evaluator")},
    "service-monitor": _BASE
    | {("Service", "probewire-worker-metrics"), ("ServiceMonitor", "probewire-worker")},
    "grafana-datasource": _BASE | {("ConfigMap", "probewire-datasource")},
}


@dataclass(frozen=True)
class Rendered:
    """One chart rendering: the values it used, the raw texts, and the parsed manifests."""

    case: str
    values: dict[str, Any]
    texts: dict[str, str]
    manifests: list[dict[str, Any]]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        found = [m for m in self.manifests if m["kind"] == kind and m["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.case}: expected one {kind}/{name}, found {len(found)}"
        return found[0]

    def pod_specs(self) -> list[dict[str, Any]]:
        return [
            m["spec"]["template"]["spec"]
            for m in self.manifests
            if m["kind"] in {"Deployment", "Job"}
        ]

    def config(self, tmp_path: Path, name: str = "probewire-config") -> Path:
        path = tmp_path / f"{name}.yaml"
        path.write_text(self.get("ConfigMap", name)["data"]["config.yaml"])
        return path


def _values(case: str) -> dict[str, Any]:
    if case == "default":
        return {}
    return helm.values_from_yaml((VALUES_DIR / f"{case}.yaml").read_text())


@pytest.fixture(scope="module")
def chart() -> typing.Iterator[helm.Chart]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def _render(chart: helm.Chart, values: dict[str, Any]) -> dict[str, str]:
    return chart.render(values, name=RELEASE, namespace=NAMESPACE)


@pytest.fixture(scope="module")
def renderings(chart: helm.Chart) -> dict[str, Rendered]:
    """Every values file rendered once for the whole module."""
    out = {}
    for case in CASES:
        values = _values(case)
        texts = _render(chart, values)
        manifests = [
            doc
            for path, text in texts.items()
            if not path.endswith("NOTES.txt")
            for doc in yaml.safe_load_all(text)
            if doc
        ]
        out[case] = Rendered(case, values, texts, manifests)
    return out


@pytest.fixture(params=CASES)
def rendered(request: pytest.FixtureRequest, renderings: dict[str, Rendered]) -> Rendered:
    return renderings[request.param]


# --- render, lint, validate -------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_lint_is_clean_in_strict_mode(case: str) -> None:
    report = helm.lint(CHART, _values(case), strict=True, kube_version=f"v{KUBE_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


def test_every_manifest_validates_against_newest_kubernetes(rendered: Rendered) -> None:
    failures = []
    for manifest in rendered.manifests:
        if manifest["kind"] in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(manifest, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            name = f"{manifest['kind']}/{manifest['metadata']['name']}"
            failures.append(f"{name}: {path}: {exc.message}")
    assert not failures, "\n".join(failures)


def test_rendered_objects_are_exactly_the_expected_ones(rendered: Rendered) -> None:
    objects = {(m["kind"], m["metadata"]["name"]) for m in rendered.manifests}
    assert objects == EXPECTED_OBJECTS[rendered.case]


def test_every_object_carries_the_standard_labels(rendered: Rendered) -> None:
    for manifest in rendered.manifests:
        labels = manifest["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "probewire"
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["helm.sh/chart"].startswith("probewire-")
        assert "app.kubernetes.io/component" in labels


# --- secrets ----------------------------------------------------------------------


def _strings(tree: Any) -> typing.Iterator[str]:
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield str(key)
            yield from _strings(value)
    elif isinstance(tree, list):
        for item in tree:
            yield from _strings(item)
    elif isinstance(tree, str):
        yield tree


def test_values_files_carry_sentinels_where_a_careless_chart_would_leak_them() -> None:
    """Guards the leak test below against becoming vacuous."""
    for case in ("sasl-kafka", "clickhouse-tls"):
        assert any(SENTINEL in s for s in _strings(_values(case))), case


def test_no_secret_value_reaches_any_rendered_file(rendered: Rendered) -> None:
    sentinels = {s for s in _strings(rendered.values) if SENTINEL in s}
    for path, text in rendered.texts.items():
        assert SENTINEL not in text, f"{path} leaks a sentinel from {sorted(sentinels)}"
    assert "Secret" not in {m["kind"] for m in rendered.manifests}, "the chart creates no Secrets"


def test_secret_env_vars_come_only_from_secret_key_refs(rendered: Rendered) -> None:
    secret_envs = {
        rendered.values.get("settings", {})
        .get("kafka", {})
        .get("sasl_password_env", "PROBEWIRE_KAFKA_SASL_PASSWORD"),
        rendered.values.get("settings", {})
        .get("clickhouse", {})
        .get("password_env", "PROBEWIRE_CLICKHOUSE_PASSWORD"),
    }
    for spec in rendered.pod_specs():
        for container in spec["containers"]:
            for entry in container.get("env", []):
                if entry["name"] in secret_envs:
                    assert "value" not in entry, entry
                    assert set(entry["valueFrom"]) == {"secretKeyRef"}, entry


@pytest.mark.parametrize(
    ("case", "env", "secret", "key"),
    [
        ("sasl-kafka", "PROBEWIRE_KAFKA_SASL_PASSWORD", "probewire-kafka-sasl", "sasl-password"),
        (
            "clickhouse-tls",
            "PROBEWIRE_CLICKHOUSE_PASSWORD",
            "probewire-clickhouse",
            "writer-password",
        ),
    ],
)
def test_password_env_var_named_by_settings_references_the_existing_secret(
    renderings: dict[str, Rendered], case: str, env: str, secret: str, key: str
) -> None:
    specs = renderings[case].pod_specs()
    assert len(specs) == 3
    for spec in specs:
        (entry,) = [e for e in spec["containers"][0]["env"] if e["name"] == env]
        assert entry == {"name": env, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ({"settings": {"kafka": {"sasl_password": "SENTINEL-a1"}}}, "sasl_password"),
        ({"settings": {"clickhouse": {"password": "SENTINEL-b2"}}}, "password"),
        (
            {"secrets": {"kafkaSasl": {"existingSecret": "kafka", "password": "SENTINEL-c3"}}},
            "password",
        ),
        ({"secrets": {"clickhouse": {"value": "SENTINEL-d4"}}}, "value"),
        ({"tls": {"kafka": {"caCert": "-----BEGIN CERTIFICATE----- SENTINEL-e5"}}}, "caCert"),
        ({"clickhousePassword": "SENTINEL-f6"}, "clickhousePassword"),
    ],
)
def test_a_secret_value_in_a_chart_key_is_refused_without_being_echoed(
    chart: helm.Chart, override: dict[str, Any], named: str
) -> None:
    with pytest.raises(helm.HelmValuesError) as caught:
        _render(chart, override)
    message = str(caught.value)
    assert named in message
    assert SENTINEL not in message


# --- TLS --------------------------------------------------------------------------


def test_kafka_ca_is_mounted_from_its_secret_and_named_in_settings(
    renderings: dict[str, Rendered], tmp_path: Path
) -> None:
    rendered = renderings["sasl-kafka"]
    settings = load_settings(rendered.config(tmp_path), env={})
    assert settings.kafka.ssl_ca_location == "/etc/probewire/tls/kafka/ca.crt"
    for spec in rendered.pod_specs():
        (volume,) = [v for v in spec["volumes"] if v["name"] == "kafka-ca"]
        assert volume["secret"]["secretName"] == "probewire-kafka-ca"
        assert volume["secret"]["items"] == [{"key": "ca.pem", "path": "ca.crt"}]
        (mount,) = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "kafka-ca"]
        assert mount == {
            "name": "kafka-ca",
            "mountPath": "/etc/probewire/tls/kafka",
            "readOnly": True,
        }


def test_clickhouse_ca_is_mounted_from_its_secret_as_the_trust_store(
    renderings: dict[str, Rendered],
) -> None:
    rendered = renderings["clickhouse-tls"]
    for spec in rendered.pod_specs():
        (volume,) = [v for v in spec["volumes"] if v["name"] == "clickhouse-ca"]
        assert volume["secret"]["secretName"] == "probewire-clickhouse-ca"
        container = spec["containers"][0]
        assert {
            "name": "SSL_CERT_FILE",
            "value": "/etc/probewire/tls/clickhouse/ca.crt",
        } in container["env"]
        assert {
            "name": "clickhouse-ca",
            "mountPath": "/etc/probewire/tls/clickhouse",
            "readOnly": True,
        } in container["volumeMounts"]


# --- settings ---------------------------------------------------------------------


def test_config_yaml_loads_with_load_settings(
    chart: helm.Chart, rendered: Rendered, tmp_path: Path
) -> None:
    loaded = load_settings(rendered.config(tmp_path), env={})
    merged = chart.merge_values(rendered.values)
    assert loaded.kafka.bootstrap == merged["settings"]["kafka"]["bootstrap"]
    assert loaded.clickhouse.url == merged["settings"]["clickhouse"]["url"]
    assert loaded.topics.partitions == merged["settings"]["topics"]["partitions"]
    assert loaded.evaluator.enabled is merged["evaluator"]["enabled"]
    hook_copy = load_settings(rendered.config(tmp_path, "probewire-migrate-config"), env={})
    assert hook_copy == loaded


def test_every_container_reads_the_mounted_config(rendered: Rendered) -> None:
    for spec in rendered.pod_specs():
        container = spec["containers"][0]
        config_env = {"name": "PROBEWIRE_CONFIG", "value": "/etc/probewire/config.yaml"}
        assert config_env in container["env"]
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "config"]
        assert mount["mountPath"] == "/etc/probewire/config.yaml"


def _settings_fields(cls: type) -> dict[str, Any]:
    """A settings class as {field: JSON type or nested dict}, all the way down."""
    json_type = {str: "string", int: "integer", float: "number", bool: "boolean"}
    hints = typing.get_type_hints(cls)
    return {
        f.name: _settings_fields(hints[f.name])
        if dataclasses.is_dataclass(hints[f.name])
        else json_type[hints[f.name]]
        for f in dataclasses.fields(cls)
    }


def _schema_fields(spec: dict[str, Any]) -> dict[str, Any]:
    assert spec["additionalProperties"] is False
    return {
        name: _schema_fields(sub) if sub["type"] == "object" else sub["type"]
        for name, sub in spec["properties"].items()
    }


def test_schema_mirrors_the_settings_tree() -> None:
    """values.schema.json knows exactly the fields of the settings tree (nested component
    configs included), with their types."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    sections = schema["properties"]["settings"]["properties"]
    root = typing.get_type_hints(settings_module.Settings)
    assert set(sections) == set(root)
    for section, cls in root.items():
        assert _schema_fields(sections[section]) == _settings_fields(cls), section


def _listed(values: dict[str, Any]) -> dict[str, Any]:
    return {k: _listed(v) if isinstance(v, dict) else type(v).__name__ for k, v in values.items()}


def test_values_yaml_lists_every_settings_field(chart: helm.Chart) -> None:
    """Every field of the settings tree appears, documented, under `settings` in values.yaml."""
    listed = chart.values["settings"]
    derived = {("evaluator", "enabled")}  # set by the chart from evaluator.enabled

    def names(tree: dict[str, Any]) -> dict[str, Any]:
        return {k: names(v) if isinstance(v, dict) else None for k, v in tree.items()}

    for section, cls in typing.get_type_hints(settings_module.Settings).items():
        fields = names(_settings_fields(cls))
        for s, n in derived:
            if s == section:
                fields.pop(n)
        assert names(_listed(listed[section])) == fields, section


def test_a_password_in_the_clickhouse_url_is_refused_without_being_echoed(
    chart: helm.Chart,
) -> None:
    with pytest.raises(helm.HelmRenderError) as caught:
        _render(
            chart,
            {"settings": {"clickhouse": {"url": "http://writer:SENTINEL-g7@clickhouse:8123"}}},
        )
    assert "settings.clickhouse.url carries credentials" in str(caught.value)
    assert SENTINEL not in str(caught.value)


def test_values_yaml_has_a_comment_above_every_field() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()
    key = re.compile(r"^\s*[A-Za-z_][\w.-]*:")
    undocumented = []
    for number, line in enumerate(lines):
        if key.match(line):
            previous = next((p for p in reversed(lines[:number]) if p.strip()), "")
            if not previous.lstrip().startswith("#"):
                undocumented.append(f"{number + 1}: {line.strip()}")
    assert not undocumented, undocumented


# --- refusals ---------------------------------------------------------------------


def test_more_workers_than_partitions_fails_with_a_clear_message(chart: helm.Chart) -> None:
    with pytest.raises(helm.HelmRenderError) as caught:
        _render(chart, {"worker": {"replicas": 5}, "settings": {"topics": {"partitions": 4}}})
    assert "worker.replicas (5) exceeds settings.topics.partitions (4)" in str(caught.value)
    assert "idles" in str(caught.value)


def test_as_many_workers_as_partitions_renders(chart: helm.Chart) -> None:
    texts = _render(chart, {"worker": {"replicas": 6}, "settings": {"topics": {"partitions": 6}}})
    assert "replicas: 6" in texts["probewire/templates/worker-deployment.yaml"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            {"evaluator": {"replicas": 5}},
            "evaluator.replicas (5) exceeds settings.topics.partitions (4)",
        ),
        (
            {"settings": {"clickhouse": {"url": "chdb:///var/lib/probewire"}}},
            "settings.clickhouse.url",
        ),
        (
            {"settings": {"kafka": {"security_protocol": "SASL_SSL", "sasl_mechanism": "PLAIN"}}},
            "secrets.kafkaSasl.existingSecret is empty",
        ),
        ({"tls": {"kafka": {"existingSecret": "kafka-ca"}}}, "does not use TLS"),
        ({"tls": {"clickhouse": {"existingSecret": "ch-ca"}}}, "is not https://"),
        (
            {"evaluator": {"enabled": False}, "settings": {"evaluator": {"enabled": True}}},
            "settings.evaluator.enabled disagrees with evaluator.enabled",
        ),
    ],
)
def test_unworkable_configurations_fail_naming_the_values(
    chart: helm.Chart, override: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm.HelmRenderError) as caught:
        _render(chart, override)
    assert message in str(caught.value)


# --- workloads --------------------------------------------------------------------


def test_services_run_their_command_with_heartbeat_probes(rendered: Rendered) -> None:
    deployments = [m for m in rendered.manifests if m["kind"] == "Deployment"]
    assert deployments
    for deployment in deployments:
        component = deployment["metadata"]["labels"]["app.kubernetes.io/component"]
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert [*container["command"], *container["args"]] == ["probewire", component]
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert container[probe]["exec"]["command"] == [
                "probewire",
                "health",
                "--component",
                component,
            ]
        assert set(container["resources"]) == {"requests", "limits"}


def test_pods_run_non_root_on_a_read_only_root_with_scratch_tmp(rendered: Rendered) -> None:
    for spec in rendered.pod_specs():
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] == 10001
        assert spec["automountServiceAccountToken"] is False
        (container,) = spec["containers"]
        context = container["securityContext"]
        assert context["readOnlyRootFilesystem"] is True
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"]["drop"] == ["ALL"]
        (tmp,) = [v for v in spec["volumes"] if v["name"] == "tmp"]
        assert "emptyDir" in tmp
        assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]


def test_migration_is_a_pre_install_and_pre_upgrade_hook(rendered: Rendered) -> None:
    job = rendered.get("Job", "probewire-migrate")
    config = rendered.get("ConfigMap", "probewire-migrate-config")
    for manifest in (job, config):
        annotations = manifest["metadata"]["annotations"]
        assert annotations["helm.sh/hook"] == "pre-install,pre-upgrade"
        assert annotations["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
    # The config copy must exist before the Job that mounts it.
    assert int(config["metadata"]["annotations"]["helm.sh/hook-weight"]) < int(
        job["metadata"]["annotations"]["helm.sh/hook-weight"]
    )
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert [*container["command"], *container["args"]] == ["probewire", "migrate"]


def test_pod_disruption_budget_selects_the_workers(rendered: Rendered) -> None:
    pdb = rendered.get("PodDisruptionBudget", "probewire-worker")
    worker = rendered.get("Deployment", "probewire-worker")
    assert pdb["spec"]["selector"] == worker["spec"]["selector"]


def test_dashboards_are_valid_json_for_the_grafana_sidecar(rendered: Rendered) -> None:
    configmap = rendered.get("ConfigMap", "probewire-dashboards")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    files = sorted(p.name for p in (CHART / "files" / "dashboards").glob("*.json"))
    assert "probewire-first-screen.json" in files
    assert sorted(configmap["data"]) == files
    for name, text in configmap["data"].items():
        dashboard = json.loads(text)
        assert {"uid", "title", "schemaVersion", "panels"} <= set(dashboard), name


def test_grafana_datasource_reads_the_store_over_http_with_the_password_from_env(
    renderings: dict[str, Rendered],
) -> None:
    configmap = renderings["grafana-datasource"].get("ConfigMap", "probewire-datasource")
    assert configmap["metadata"]["labels"]["grafana_datasource"] == "1"
    [source] = yaml.safe_load(configmap["data"]["probewire-datasource.yaml"])["datasources"]
    assert source["type"] == "grafana-clickhouse-datasource"
    assert source["jsonData"] == {
        "host": "clickhouse.example.svc",
        "port": 8443,
        "protocol": "http",
        "secure": True,
        "defaultDatabase": "probewire",
        "username": "grafana_reader",
    }
    assert source["secureJsonData"] == {"password": "${GRAFANA_CLICKHOUSE_PASSWORD}"}
    default = renderings["default"]
    assert ("ConfigMap", "probewire-datasource") not in {
        (m["kind"], m["metadata"]["name"]) for m in default.manifests
    }


def test_grafana_datasource_takes_the_port_of_the_url(chart: helm.Chart) -> None:
    texts = _render(
        chart,
        {
            "settings": {"clickhouse": {"url": "http://ch.svc:18123"}},
            "dashboards": {"datasource": {"enabled": True, "passwordEnv": ""}},
        },
    )
    [text] = [t for path, t in texts.items() if path.endswith("datasource-configmap.yaml")]
    data = yaml.safe_load(yaml.safe_load(text)["data"]["probewire-datasource.yaml"])
    [source] = data["datasources"]
    assert (source["jsonData"]["host"], source["jsonData"]["port"]) == ("ch.svc", 18123)
    assert source["jsonData"]["secure"] is False and "secureJsonData" not in source


def test_service_monitor_scrapes_the_worker_metrics_port(renderings: dict[str, Rendered]) -> None:
    rendered = renderings["service-monitor"]
    monitor = rendered.get("ServiceMonitor", "probewire-worker")
    service = rendered.get("Service", "probewire-worker-metrics")
    worker = rendered.get("Deployment", "probewire-worker")
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (endpoint,) = monitor["spec"]["endpoints"]
    (port,) = service["spec"]["ports"]
    assert endpoint["port"] == port["name"] == "metrics"
    assert endpoint["path"] == "/metrics"
    assert service["spec"]["selector"] == worker["spec"]["selector"]["matchLabels"]
    (container,) = worker["spec"]["template"]["spec"]["containers"]
    assert {"name": "metrics", "containerPort": 6066, "protocol": "TCP"} in container["ports"]


@pytest.mark.parametrize("component", ["worker", "evaluator"])
def test_images_run_as_the_uid_the_chart_requires(component: str) -> None:
    dockerfile = (REPO / "deploy" / "docker" / f"{component}.Dockerfile").read_text()
    assert re.search(r"^USER 10001:10001$", dockerfile, re.MULTILINE)
    assert 'ENTRYPOINT ["probewire"]' in dockerfile
    assert f'CMD ["{component}"]' in dockerfile


# --- the alert webhook and the Grafana password name -------------------------------


def test_a_webhook_url_in_the_settings_is_refused_without_being_echoed(chart: helm.Chart) -> None:
    """settings.stream.alert_webhook_url would land in both ConfigMaps: refused, naming
    where the URL goes instead, and the URL (its token) is not in the message."""
    with pytest.raises(helm.HelmRenderError) as caught:
        _render(
            chart, {"settings": {"stream": {"alert_webhook_url": "https://h.example/SENTINEL-h8"}}}
        )
    assert "secrets.alertWebhook.existingSecret" in str(caught.value)
    assert SENTINEL not in str(caught.value)


def test_the_webhook_url_reaches_the_worker_from_its_secret_only(chart: helm.Chart) -> None:
    """With secrets.alertWebhook the worker (and only the worker) gets the URL from a
    secretKeyRef as the settings override PROBEWIRE_STREAM__ALERT_WEBHOOK_URL."""
    texts = _render(
        chart, {"secrets": {"alertWebhook": {"existingSecret": "hooks", "urlKey": "u"}}}
    )
    manifests = [
        doc
        for path, text in texts.items()
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    ]
    found = {}
    for m in manifests:
        if m["kind"] in {"Deployment", "Job"}:
            for c in m["spec"]["template"]["spec"]["containers"]:
                for e in c.get("env", []):
                    if e["name"] == "PROBEWIRE_STREAM__ALERT_WEBHOOK_URL":
                        found[m["metadata"]["name"]] = e
    assert found == {
        "probewire-worker": {
            "name": "PROBEWIRE_STREAM__ALERT_WEBHOOK_URL",
            "valueFrom": {"secretKeyRef": {"name": "hooks", "key": "u"}},
        }
    }


def test_a_grafana_password_env_that_is_not_a_name_is_refused_without_being_echoed(
    chart: helm.Chart,
) -> None:
    """dashboards.datasource.passwordEnv holding a value (not a variable name) is refused
    naming the key, without echoing the value."""
    override = {"dashboards": {"datasource": {"enabled": True, "passwordEnv": "SENTINEL-i9 pw!"}}}
    with pytest.raises((helm.HelmRenderError, helm.HelmValuesError)) as caught:
        _render(chart, override)
    assert "dashboards.datasource.passwordEnv" in str(caught.value)
    assert SENTINEL not in str(caught.value)
