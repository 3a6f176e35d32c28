# The learner: DeepSpeed on the CUDA build of torch from PyPI, at the versions the tests pass
# on. docker/versions.env states them once; this file sources it, and
# tests/chart/test_images_match.py fails when the two drift apart.
# PyPI's torch is a CUDA build that brings its own CUDA libraries (cuda-toolkit, cuDNN, NCCL
# wheels): the base is plain Python, and nodes need an NVIDIA driver for the CUDA release that
# versions.env names beside TORCH_VERSION.
# Not built by this project's CI: its machines have no Docker engine and reach only PyPI,
# Debian and npm, so the tests read this file instead of building it.
# Build from the repository root: docker build -f docker/learner.Dockerfile -t gspo-learner .
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY trainer ./trainer
# This project's own wheel only; its dependencies are resolved once, in the final stage.
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:${PYTHON_VERSION}-slim-bookworm
# g++: DeepSpeed compiles a small communication op on first use (its other ops are not built).
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --create-home --shell /usr/sbin/nologin gspo
COPY docker/versions.env /opt/gspo/versions.env
COPY --from=build /wheels /wheels
# The base's Python must be versions.env's. One resolver run with every pin: a pin that
# the others exclude fails the build.
RUN . /opt/gspo/versions.env \
    && test "$(python -c 'import sys; print("%d.%d" % sys.version_info[:2])')" \
        = "${PYTHON_VERSION}" \
    && DS_BUILD_OPS=0 pip install --no-cache-dir --find-links /wheels \
        "gspo-operator[learner]" \
        "torch==${TORCH_VERSION}" \
        "transformers==${TRANSFORMERS_VERSION}" \
        "deepspeed==${DEEPSPEED_VERSION}" \
    && rm -rf /wheels
ENV DS_BUILD_OPS=0 PYTHONUNBUFFERED=1
USER 10001
EXPOSE 9090 29500
ENTRYPOINT ["gspo", "learner"]
