# The operator: kopf + the official Kubernetes client, on a slim Python base. No torch.
# Its Python is the one the tests pass on: PYTHON_VERSION in docker/versions.env, checked by
# tests/chart/test_images_match.py (and by the build, against the image's interpreter).
# Not built by this project's CI: its machines have no Docker engine and reach only PyPI,
# Debian and npm, so the tests read this file instead of building it.
# Build from the repository root: docker build -f docker/operator.Dockerfile -t gspo-operator .
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY trainer ./trainer
COPY docker/versions.env /opt/gspo/versions.env
# The base's Python must be versions.env's.
RUN . /opt/gspo/versions.env \
    && test "$(python -c 'import sys; print("%d.%d" % sys.version_info[:2])')" \
        = "${PYTHON_VERSION}" \
    && pip wheel --no-cache-dir --wheel-dir /wheels ".[operator]"

FROM python:${PYTHON_VERSION}-slim-bookworm
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin gspo
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels "gspo-operator[operator]" \
    && rm -rf /wheels
USER 10001
EXPOSE 8080 8081
ENTRYPOINT ["gspo", "operator"]
