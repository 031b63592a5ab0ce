"""scripts/offline_host/gpu_stages.sh: the four stages that split suite-rest-b1 select its test files, each once.

The script is run with a `python3` that only records its arguments, so no test runs; the files each stage's
pytest call would collect are worked out from those arguments (paths, and --ignore=path)."""
import os
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPLIT = ("suite-kernels-3", "suite-engine-quant", "suite-engine-other", "suite-smollm2")


def _pytest_args(stage: str, tmp_path: Path, rc: int = 0) -> list[str]:
    bin_dir, record = tmp_path / "bin", tmp_path / f"{stage}.args"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "python3"
    fake.write_text('#!/bin/sh\nif [ "$1" = "-m" ] && [ "$2" = "pytest" ]; then printf "%s\\n" "$@" > "$RECORD";'
                    ' echo "collected by the fake"; exit "${FAKE_RC:-0}"; fi\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", RECORD=str(record), FAKE_RC=str(rc))
    proc = subprocess.run(["bash", "scripts/offline_host/gpu_stages.sh", stage, "test", str(tmp_path / "out")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == rc, proc.stderr
    return record.read_text().split("\n")[:-1]


def _selected(args: list[str]) -> set[str]:
    paths = [a for a in args if a.startswith("tests")]
    ignored = [a.split("=", 1)[1] for a in args if a.startswith("--ignore=")]
    files = set()
    for p in paths:
        full = ROOT / p
        files |= {str(f.relative_to(ROOT)) for f in full.rglob("test_*.py")} if full.is_dir() else {p}
    return {f for f in files if not any(f == i or f.startswith(i.rstrip("/") + "/") for i in ignored)}


def test_the_split_stages_cover_suite_rest_b1_once(tmp_path):
    whole = _selected(_pytest_args("suite-rest-b1", tmp_path))
    parts = {stage: _selected(_pytest_args(stage, tmp_path)) for stage in SPLIT}
    assert all(parts.values()), parts
    assert set().union(*parts.values()) == whole
    assert sum(len(p) for p in parts.values()) == len(whole)          # no file in two stages
    assert "tests/engine/test_smollm2.py" in parts["suite-smollm2"]
    assert "tests/engine/test_quant_linear.py" in parts["suite-engine-quant"]
    assert "tests/kernels/test_shrink.py" not in whole


def test_a_stage_logs_pytest_directly_and_keeps_its_exit_status(tmp_path):
    """pytest's output goes straight to the stage's log (a call that runs out of time keeps it), and a failing
    run fails the stage."""
    args = _pytest_args("suite-engine-other", tmp_path, rc=1)
    assert args[args.index("-m", 2) + 1] == "gpu" and "--timeout=300" in args
    assert "collected by the fake" in (tmp_path / "out" / "suite-engine-other.log").read_text()
