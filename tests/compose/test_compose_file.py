"""compose.yaml validates with docker-compose v1 and describes the deployment users rely on."""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess

import pytest
import yaml

from cache_service.config import CacheConfig
from compute_service.config import ComputeConfig
from gateway.config import GatewayConfig
from loraplex.settings import ENV_PREFIX, settings_from_args

from compose_files import COMPOSE, COMPOSE_CPU, ROOT, compose_config, docker_compose_bin, service_env

CONFIGS = {"cache": CacheConfig, "compute": ComputeConfig, "gateway": GatewayConfig}
PORTS = {"gateway": 50051, "cache": 50052, "compute": 50053}


@pytest.fixture(scope="module")
def config():
    return compose_config(COMPOSE)


def test_config_quiet_passes():
    out = subprocess.run([docker_compose_bin(), "-f", str(COMPOSE), "config", "-q"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr


def test_file_format_is_3x_with_no_top_level_name():
    raw = yaml.safe_load(COMPOSE.read_text())
    assert str(raw["version"]).startswith("3."), "compose v1 validates only the 3.x format"
    assert "name" not in raw, "compose v1 rejects a top-level name:"


def test_services(config):
    assert set(config["services"]) == {"redis", "cache", "compute", "gateway"}
    redis = config["services"]["redis"]
    assert re.fullmatch(r"redis:[\w.]+", redis["image"]), "the official redis image"
    assert redis["healthcheck"]["test"][-2:] == ["redis-cli", "ping"]
    # no persistence: the host cache is a cache
    assert redis["command"] == ["redis-server", "--save", "", "--appendonly", "no"]


def test_only_the_gateway_is_published(config):
    for name, svc in config["services"].items():
        if name == "gateway":
            assert svc["ports"] == [{"published": 50051, "target": 50051}, {"published": 8000, "target": 8000}]
        else:
            assert "ports" not in svc, f"{name} is internal and must not be published to the host"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_env_names_are_real_settings_and_parse(config, name):
    """Every LORAPLEX_* variable is a field of the service's config and its value parses."""
    env = service_env(config, name)
    fields = {ENV_PREFIX + f.name.upper() for f in dataclasses.fields(CONFIGS[name])}
    unknown = sorted(set(env) - fields)
    assert not unknown, f"{name}: {unknown} are not settings of {CONFIGS[name].__name__}"
    settings = settings_from_args(CONFIGS[name], None, environ=env)
    assert settings.listen == f"0.0.0.0:{PORTS[name]}", "containers must listen on every interface"
    assert config["services"][name]["command"] == [name]


def test_addresses_point_at_services(config):
    cache = settings_from_args(CacheConfig, None, environ=service_env(config, "cache"))
    assert cache.backend == "redis" and cache.redis_url.startswith("redis://redis:6379")
    compute = settings_from_args(ComputeConfig, None, environ=service_env(config, "compute"))
    assert compute.cache_address == "cache:50052" and compute.device.startswith("cuda")
    gateway = settings_from_args(GatewayConfig, None, environ=service_env(config, "gateway"))
    assert gateway.cache_address == "cache:50052"
    assert gateway.compute_addresses == ("dns:///compute:50053",)
    for name in ("cache", "compute"):
        assert config["services"][name]["expose"] == [str(PORTS[name])]


def test_grpc_healthchecks(config):
    probe = ROOT / "docker" / "healthcheck.py"
    assert probe.is_file()
    for name in CONFIGS:
        test = config["services"][name]["healthcheck"]["test"]
        assert test == ["CMD", "python", "/opt/loraplex/docker/healthcheck.py"], name
    assert config["services"]["compute"]["healthcheck"]["start_period"] in ("10m", "600s")


def test_depends_on_waits_for_health(config):
    services = config["services"]
    expected = {"cache": {"redis"}, "compute": {"cache"}, "gateway": {"cache", "compute"}}
    for name, deps in expected.items():
        depends = services[name]["depends_on"]
        assert set(depends) == deps, name
        for dep in deps:
            assert depends[dep] == {"condition": "service_healthy"}
            assert "healthcheck" in services[dep], f"{name} waits on {dep}, which has no healthcheck"


def test_compute_gpu_reservation_and_read_only_mounts(config):
    compute = config["services"]["compute"]
    devices = compute["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    mounts = {v.split(":")[1]: v.split(":")[2] for v in compute["volumes"]}
    assert mounts == {"/models": "ro", "/adapters": "ro", "/home/loraplex/.triton": "rw"}
    assert [v for v in compute["volumes"] if v.startswith("kernel-cache:")], "compiled kernels kept in a volume"
    assert "kernel-cache" in config["volumes"]
    assert compute["build"]["args"]["TORCH_INDEX_URL"].rstrip("/").endswith("cu128")
    assert compute["build"]["args"]["BASE_IMAGE"].startswith("nvidia/cuda:")


def test_variables_reach_the_services():
    env = dict(os.environ, LORAPLEX_MODEL="/models/llama.gguf", LORAPLEX_GATEWAY_PORT="6000",
               LORAPLEX_COMPUTE_ADDRESSES="10.0.0.2:50053,10.0.0.3:50053")
    config = compose_config(COMPOSE, env=env)
    for name in ("cache", "compute", "gateway"):
        assert service_env(config, name)["LORAPLEX_MODEL"] == "/models/llama.gguf"
    assert config["services"]["gateway"]["ports"] == [{"published": 6000, "target": 50051},
                                                      {"published": 8000, "target": 8000}]
    gateway = settings_from_args(GatewayConfig, None, environ=service_env(config, "gateway"))
    assert gateway.compute_addresses == ("10.0.0.2:50053", "10.0.0.3:50053")
