# The learner: DeepSpeed on PyTorch's own CUDA image (devel, so DeepSpeed can JIT its ops).
# Build from the repository root: docker build -f docker/learner.Dockerfile -t gspo-learner .
ARG BASE=pytorch/pytorch:2.8.0-cuda12.8-cudnn9-devel
FROM ${BASE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY trainer ./trainer
# Keep the base image's torch: pip must not replace it with another build.
RUN python -c "import torch; print(f'torch=={torch.__version__}')" > /tmp/keep-torch.txt \
    && pip wheel --no-cache-dir --wheel-dir /wheels -c /tmp/keep-torch.txt ".[learner]" \
    && rm -f /wheels/torch-*.whl

FROM ${BASE}
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin gspo
COPY --from=build /wheels /wheels
COPY --from=build /tmp/keep-torch.txt /tmp/keep-torch.txt
RUN pip install --no-cache-dir --find-links /wheels -c /tmp/keep-torch.txt \
        "gspo-operator[learner]" \
    && rm -rf /wheels
ENV DS_BUILD_OPS=0 PYTHONUNBUFFERED=1
USER 10001
EXPOSE 9090 29500
ENTRYPOINT ["gspo", "learner"]
