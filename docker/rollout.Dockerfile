# The rollout server: vLLM's own OpenAI-server image, which brings CUDA vLLM and its torch.
# Build from the repository root: docker build -f docker/rollout.Dockerfile -t gspo-rollout .
ARG BASE=vllm/vllm-openai:v0.11.0
FROM ${BASE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY trainer ./trainer
# Keep the base image's torch and vllm exactly as vLLM built them.
RUN python3 -c "import torch, vllm; print(f'torch=={torch.__version__}\nvllm=={vllm.__version__}')" \
        > /tmp/keep.txt \
    && pip wheel --no-cache-dir --wheel-dir /wheels -c /tmp/keep.txt ".[rollout]" \
    && rm -f /wheels/torch-*.whl /wheels/vllm-*.whl

FROM ${BASE}
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin gspo
COPY --from=build /wheels /wheels
COPY --from=build /tmp/keep.txt /tmp/keep.txt
RUN pip install --no-cache-dir --find-links /wheels -c /tmp/keep.txt "gspo-operator[rollout]" \
    && rm -rf /wheels
ENV PYTHONUNBUFFERED=1 HF_HOME=/home/gspo/.cache/huggingface
USER 10001
EXPOSE 8000 9090
ENTRYPOINT ["gspo", "rollout-server"]
