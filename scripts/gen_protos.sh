#!/usr/bin/env bash
# Generates the Python gRPC stubs from protos/ into loraplex/v1/ (git-ignored).
# Regenerates only when a .proto is newer than the stubs.
set -euo pipefail
cd "$(dirname "$0")/.."
out=loraplex/v1
mkdir -p "$out"
newest_proto=$(ls -t protos/loraplex/v1/*.proto | head -1)
if [ -f "$out/gateway_pb2.py" ] && [ "$out/gateway_pb2.py" -nt "$newest_proto" ] && [ -f "$out/__init__.py" ]; then
  exit 0
fi
.venv/bin/python -m grpc_tools.protoc -Iprotos \
  --python_out=. --pyi_out=. --grpc_python_out=. protos/loraplex/v1/*.proto
echo '"""Generated gRPC stubs for loraplex.v1 (made by scripts/gen_protos.sh; do not edit)."""' > "$out/__init__.py"
echo "[setup] generated stubs in $out" >&2
