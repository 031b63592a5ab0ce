"""deploy/k8s: every manifest validates against Kubernetes' schemas (offline, strict), and the pieces fit.

`kubernetes-validate` (pinned in the test extra) carries the OpenAPI schemas of
each Kubernetes release, so nothing is fetched. Beyond the schemas: every
LORAPLEX_* variable is a real setting whose value parses, addresses point at
the Services, compute asks for a GPU and has gRPC probes with a start-up
allowance long enough for model load and warm-up, the compute Service is
headless (so the gateway's `dns:///` address finds every replica), the
gateway Service has the HTTP and gRPC ports, pods carry scrape annotations.
"""
from __future__ import annotations

import copy
import functools
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from cache_service.config import CacheConfig
from compute_service.config import ComputeConfig
from gateway.config import GatewayConfig
from loraplex.settings import settings_from_args

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
VERSIONS = ("1.29.0", "1.37.0")    # an older release still in use, and the newest the validator knows
CONFIGS = {"cache": CacheConfig, "compute": ComputeConfig, "gateway": GatewayConfig}


@functools.cache
def _parsed() -> tuple[tuple[str, dict], ...]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return tuple(docs)


def manifests() -> list[tuple[str, dict]]:
    """(file name, a fresh copy of each document), parsed once."""
    return copy.deepcopy(list(_parsed()))


def by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for _, d in manifests() if d["kind"] == kind}


def container(name: str) -> dict:
    return by_kind("Deployment")[name]["spec"]["template"]["spec"]["containers"][0]


def env_of(name: str) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container(name)["env"]}


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_validates_strictly(version):
    docs = manifests()
    assert len(docs) >= 10
    for file, doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{file}: {doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}")


def test_the_validator_rejects_a_broken_manifest():
    doc = next(yaml.safe_load_all((K8S / "gateway.yaml").read_text()))
    doc["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "fifty"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)
    doc = next(yaml.safe_load_all((K8S / "gateway.yaml").read_text()))
    doc["spec"]["template"]["spec"]["containers"][0]["startupProbes"] = {}   # a misspelt field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)


def test_kustomization_lists_every_manifest():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kust["resources"]) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    images = {i["name"] for i in kust["images"]}
    for name in CONFIGS:
        assert container(name)["image"] in images


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_env_names_are_real_settings_and_parse(name):
    env = env_of(name)
    fields = {"LORAPLEX_" + f.upper() for f in CONFIGS[name].__dataclass_fields__}
    assert {k for k in env if k.startswith("LORAPLEX_")} <= fields
    config = settings_from_args(CONFIGS[name], None, environ=env)
    assert config.metrics_port == 9090 and config.log_format == "json"
    port = int(config.listen.rsplit(":", 1)[1])
    assert {p["containerPort"] for p in container(name)["ports"]} >= {port, config.metrics_port}
    annotations = by_kind("Deployment")[name]["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": "9090",
                           "prometheus.io/path": "/metrics"}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container(name)[probe]["grpc"]["port"] == port, (name, probe)


def test_addresses_point_at_services():
    services = by_kind("Service")
    cache = settings_from_args(CacheConfig, None, environ=env_of("cache"))
    assert cache.backend == "redis" and cache.redis_url == "redis://redis:6379/0"
    assert [p["port"] for p in services["redis"]["spec"]["ports"]] == [6379]
    for name in ("compute", "gateway"):
        config = settings_from_args(CONFIGS[name], None, environ=env_of(name))
        assert config.cache_address == "cache:50052"
    assert [p["port"] for p in services["cache"]["spec"]["ports"]] == [50052]
    gateway = settings_from_args(GatewayConfig, None, environ=env_of("gateway"))
    assert gateway.compute_addresses == ("dns:///compute:50053",)
    assert services["compute"]["spec"]["clusterIP"] == "None", "headless: DNS must answer with every replica"
    assert [p["port"] for p in services["compute"]["spec"]["ports"]] == [50053]
    assert {p["name"]: p["port"] for p in services["gateway"]["spec"]["ports"]} == {"http": 8000, "grpc": 50051}
    assert gateway.http_listen == "0.0.0.0:8000" and gateway.listen == "0.0.0.0:50051"


def test_compute_has_a_gpu_and_time_to_warm_up():
    deploy = by_kind("Deployment")["compute"]
    assert deploy["spec"]["replicas"] >= 2, "replicas share the host cache behind the gateway's routing"
    c = container("compute")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 == c["resources"]["requests"]["nvidia.com/gpu"]
    assert env_of("compute")["LORAPLEX_DEVICE"] == "cuda"
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 900, "model load + warm-up take minutes"
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert "/dev/shm" in mounts
