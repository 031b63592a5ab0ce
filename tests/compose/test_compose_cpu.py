"""Overrides of compose.yaml: the CPU one, and the GPU-replica example in docs/deploy.md, validate."""
from __future__ import annotations

import re

import yaml

from compute_service.config import ComputeConfig
from gateway.config import GatewayConfig
from loraplex.settings import settings_from_args

from compose_files import COMPOSE, COMPOSE_CPU, _Reset, compose_config, load_with_reset, merge, service_env


def test_override_resets_the_gpu_reservation():
    override = load_with_reset(COMPOSE_CPU)
    assert isinstance(override["services"]["compute"]["deploy"], _Reset)
    assert set(override["services"]) == {"compute"}, "only compute differs on a CPU machine"


def test_merged_file_validates_and_runs_compute_on_cpu(tmp_path):
    merged = merge(load_with_reset(COMPOSE), load_with_reset(COMPOSE_CPU))
    path = tmp_path / "compose.merged.yaml"
    path.write_text(yaml.safe_dump(merged, sort_keys=False))
    config = compose_config(path)
    compute = config["services"]["compute"]
    assert "deploy" not in compute, "a GPU reservation fails on a machine with no GPU"
    assert compute["image"] == "loraplex:cpu"
    assert compute["build"]["args"] == {"BASE_IMAGE": "debian:bookworm-slim", "TORCH_INDEX_URL": ""}
    settings = settings_from_args(ComputeConfig, None, environ=service_env(config, "compute"))
    assert settings.device == "cpu"
    # the rest of the deployment is unchanged
    base = compose_config(COMPOSE)
    for name in ("redis", "cache", "gateway"):
        assert config["services"][name] == base["services"][name]
    assert compute["depends_on"] == base["services"]["compute"]["depends_on"]
    assert compute["volumes"] == base["services"]["compute"]["volumes"]


def test_documented_gpu_replica_override_validates(tmp_path):
    """The two-GPU example in docs/deploy.md is a working override of compose.yaml."""
    doc = (COMPOSE.parent / "docs" / "deploy.md").read_text()
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", doc, re.S) if "compute-1:" in b)
    path = tmp_path / "compose.override.yaml"
    path.write_text(block)
    config = compose_config(COMPOSE, path)
    replica = config["services"]["compute-1"]
    assert replica["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["1"]
    assert service_env(config, "compute-1") == {
        k: v for k, v in service_env(config, "compute").items() if k in service_env(config, "compute-1")}
    assert "ports" not in replica
    gateway = settings_from_args(GatewayConfig, None, environ=service_env(config, "gateway"))
    assert gateway.compute_addresses == ("dns:///compute:50053", "dns:///compute-1:50053")
    assert set(config["services"]["gateway"]["depends_on"]) == {"cache", "compute", "compute-1"}
