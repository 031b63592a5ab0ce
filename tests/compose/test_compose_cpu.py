"""The CPU override turns compute into a CPU service with no GPU reservation, and still validates."""
from __future__ import annotations

import yaml

from compute_service.config import ComputeConfig
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
