"""deploy/kubernetes/: the core kinds against Kubernetes' own schemas (`kubernetes-validate`,
strict: an unknown field fails), the Gateway API and Inference Extension kinds by their
required fields, and every cross-reference between the files (labels, ports, paths)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from vllm_proxy.config import parse_config
from vllm_proxy.frontend.gate import METRICS_PATHS

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
KUBERNETES = "1.33"
CORE = {"ConfigMap", "DaemonSet", "Deployment", "Service"}


def documents(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def by_kind(name: str) -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in documents(name)}


MANIFESTS = [(f.name, i) for f in sorted(DEPLOY.glob("*.yaml")) if f.name != "epp-values.yaml"
             for i in range(len(documents(f.name)))]  # fmt: skip


@pytest.mark.parametrize(("name", "index"), MANIFESTS, ids=[f"{n}#{i}" for n, i in MANIFESTS])
def test_each_manifest_is_valid(name: str, index: int) -> None:
    doc = documents(name)[index]
    if doc["kind"] in CORE:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    elif doc["kind"] == "InferencePool":
        assert doc["apiVersion"] == "inference.networking.k8s.io/v1"
        spec = doc["spec"]
        assert spec["selector"]["matchLabels"]
        assert 1 <= len(spec["targetPorts"]) <= 8
        assert all(1 <= p["number"] <= 65535 for p in spec["targetPorts"])
        ref = spec["endpointPickerRef"]
        assert ref["name"] and 1 <= ref["port"]["number"] <= 65535
        assert ref["failureMode"] in ("FailOpen", "FailClose")
    elif doc["kind"] == "HTTPRoute":
        assert doc["apiVersion"] == "gateway.networking.k8s.io/v1"
        assert doc["spec"]["parentRefs"]
        for rule in doc["spec"]["rules"]:
            assert rule["backendRefs"]
    else:
        pytest.fail(f"{name}: no check for kind {doc['kind']}")


def test_the_checks_refuse_a_bad_manifest() -> None:
    service = by_kind("vllm-proxy.yaml")["Service"]
    bad = {**service, "spec": {**service["spec"], "portz": []}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES, strict=True)


def test_the_files_agree_with_each_other_and_with_the_proxy() -> None:
    proxy = by_kind("vllm-proxy.yaml")
    config = parse_config(yaml.safe_load(proxy["ConfigMap"]["data"]["config.yaml"]))
    assert config.server.host == "0.0.0.0", "the pods answer on their own address"
    assert not config.server.metrics_api_keys, "the picker scrapes without a key"
    pod = proxy["DaemonSet"]["spec"]["template"]
    labels = pod["metadata"]["labels"]
    (container,) = pod["spec"]["containers"]
    ports = {p["containerPort"] for p in container["ports"]}
    assert config.server.port in ports
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "config")
    assert volume["configMap"]["name"] == proxy["ConfigMap"]["metadata"]["name"]

    pool = by_kind("inferencepool.yaml")
    spec = pool["InferencePool"]["spec"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    assert {p["number"] for p in spec["targetPorts"]} <= ports
    backend = pool["HTTPRoute"]["spec"]["rules"][0]["backendRefs"][0]
    assert backend["kind"] == "InferencePool"
    assert backend["name"] == pool["InferencePool"]["metadata"]["name"]

    values = yaml.safe_load((DEPLOY / "epp-values.yaml").read_text())
    assert values["inferencePool"]["modelServers"]["matchLabels"].items() <= labels.items()
    assert {p["number"] for p in values["inferencePool"]["targetPorts"]} <= ports
    ext = values["inferenceExtension"]
    assert ext["modelServerMetricsPath"] == "/metrics/model-server"
    assert ext["modelServerMetricsPath"] in METRICS_PATHS, "a page the proxy serves"
    picker = yaml.safe_load(ext["pluginsCustomConfig"][ext["pluginsConfigFile"]])
    assert picker["kind"] == "EndpointPickerConfig"
    assert "lora-affinity-scorer" in {p["type"] for p in picker["plugins"]}
    (profile,) = picker["schedulingProfiles"]
    weights = {p["pluginRef"]: p.get("weight") for p in profile["plugins"]}
    assert weights["lora-affinity-scorer"] > weights["queue-scorer"], "residency first"
    assert set(weights) <= {p.get("name", p["type"]) for p in picker["plugins"]}
