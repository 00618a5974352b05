# adstream: one image for every role (streams worker, trainer, Serve app, Ray head/worker nodes,
# migrations). CPU by default; the CUDA variant only swaps the torch wheel (PyTorch's CUDA wheels
# carry their CUDA runtime; the host needs the NVIDIA driver + container toolkit):
#   docker build -t adstream:0.1.0 .
#   docker build -t adstream:0.1.0-cuda --build-arg TORCH_VARIANT=cu128 .
# Other build args: PYTHON_IMAGE (3.11–3.13, the project's requires-python), EXTRAS (e.g. "bench":
# the benchmarks' own dependencies, for `adstream bench` in the image; the runtime has none of
# the benchmark and test tools by default). tests/unit/test_packaging.py checks these paths.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm
FROM ${PYTHON_IMAGE}

# cpu, or a CUDA build tag of download.pytorch.org (cu126, cu128, …)
ARG TORCH_VARIANT=cpu
ARG TORCH_VERSION=2.13.0
# extras of the project to install besides the runtime (comma-separated: bench, chdb)
ARG EXTRAS=""

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/adstream/venv \
    PATH=/opt/adstream/venv/bin:$PATH \
    ADSTREAM_STATE_DIR=/var/lib/adstream \
    ADSTREAM_MODEL_DIR=/var/lib/adstream/models

# curl for health checks; no Redis/ClickHouse servers here: compose and k8s run the upstream images
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends curl ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 1000 adstream \
    && mkdir -p /var/lib/adstream/models && chown -R adstream /var/lib/adstream

WORKDIR /opt/adstream/src
RUN python -m venv "$VIRTUAL_ENV" \
    && pip install -q --upgrade pip \
    && pip install -q "torch==${TORCH_VERSION}" --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"

# dependencies first (cached while only code changes), then the code. The torch pin is left out
# of the constraints: the wheel installed above (2.13.0+cpu or +cu…) satisfies torch==2.13.0; the
# last RUN checks that no later install replaced it.
COPY pyproject.toml constraints.txt README.md LICENSE ./
RUN PKGS="schemas streams trainers serving attribution workloads deploy creatives adstream_client benchmarks" \
    && for p in $PKGS; do mkdir -p $p && touch $p/__init__.py; done \
    && grep -v '^torch==' constraints.txt > /tmp/constraints.txt \
    && pip install -q -c /tmp/constraints.txt ".${EXTRAS:+[$EXTRAS]}" \
    && pip uninstall -q -y adstream
COPY schemas schemas
COPY streams streams
COPY trainers trainers
COPY serving serving
COPY attribution attribution
COPY workloads workloads
COPY deploy deploy
COPY creatives creatives
COPY adstream_client adstream_client
COPY benchmarks benchmarks
RUN pip install -q --no-deps . && adstream --help >/dev/null && adstream bench --help >/dev/null \
    && python -c "import torch; assert torch.__version__ == '${TORCH_VERSION}+${TORCH_VARIANT}', torch.__version__"

USER adstream
WORKDIR /var/lib/adstream
EXPOSE 8000 9464
ENTRYPOINT []
CMD ["adstream", "--help"]
