# The operator: kopf + the official Kubernetes client, on a slim Python base. No torch.
# Build from the repository root: docker build -f docker/operator.Dockerfile -t gspo-operator .
FROM python:3.11.10-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY trainer ./trainer
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[operator]"

FROM python:3.11.10-slim-bookworm
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin gspo
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels "gspo-operator[operator]" \
    && rm -rf /wheels
USER 10001
EXPOSE 8080 8081
ENTRYPOINT ["gspo", "operator"]
