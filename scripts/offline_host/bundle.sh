#!/usr/bin/env bash
# Builds .offline/ (git-ignored): what a GPU host without network needs to run loraplex's tests and
# benchmarks beside its own torch/triton/transformers, in pieces of at most 64 MiB:
#   .offline/wheels/   Python 3.12 manylinux wheels of the other dependencies (no numpy/torch)
#   .offline/model_1/ .. model_3/   the default SmolLM2 GGUF in three parts, each with the whole file's
#                      sha256 and the number of parts (a part with the tree fits one call; halves no longer do)
#   .offline/tools/    a sampling profiler for the services' Python threads (py-spy; carry it with the
#                      wheels: the tree with either model half leaves no room for more)
# Copy the repository with .offline/ and loraplex/v1/ (generated stubs) to the host, then
# `source scripts/offline_host/activate.sh` there (docs/performance.md, "On a GPU host without network").
set -euo pipefail
cd "$(dirname "$0")/../.."
py=.venv/bin/python
[ -x "$py" ] || { echo "run make setup first" >&2; exit 1; }
out=.offline
parts=3
mkdir -p "$out/wheels" "$out/tools"
$py -m pip download -q -d "$out/wheels" --only-binary=:all: --no-deps --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  grpcio==1.85.1 grpcio-reflection==1.85.1 grpcio-health-checking==1.85.1 "protobuf>=6.31" "redis>=5.0" \
  "prometheus-client>=0.20" "gguf>=0.10" "starlette==1.10.0" "uvicorn==0.54.0" h11 click anyio sniffio \
  "pytest>=8" pluggy iniconfig "pytest-timeout>=2.3" "hypothesis>=6.100" sortedcontainers \
  "pytest-xdist>=3.5" "execnet>=2.1"
$py -m pip download -q -d "$out/tools" --only-binary=:all: --no-deps --python-version 3.12 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 "py-spy==0.4.3"
gguf=$($py -c "from loraplex.model_files import default_model_path; print(default_model_path())")
sha=$(sha256sum "$gguf" | cut -d' ' -f1)
rm -rf "$out"/model_?
split -n "$parts" -d -a 1 "$gguf" "$out/part."
for i in $(seq 1 "$parts"); do
  mkdir -p "$out/model_$i"
  mv "$out/part.$((i - 1))" "$out/model_$i/part"
  echo "$sha" > "$out/model_$i/sha256"
  echo "$parts" > "$out/model_$i/parts"
done
bash scripts/gen_protos.sh
du -sh "$out"/* loraplex/v1 >&2
echo "[offline] carry .offline/model_1 + loraplex/v1, then model_2, then model_3 with .offline/wheels (64 MiB a call," \
  "the tree included; each call sources activate.sh, which keeps the parts in /tmp and joins them)" >&2
