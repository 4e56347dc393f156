# darkroom worker image. Build: docker build -t darkroom .  (or podman build: the recipe
# and its measured figures are in docs/kubernetes.md; the manifests in deploy/kubernetes/).
# libvips and libheif come bundled in the pyvips-binary / pi-heif wheels, so no
# apt packages are needed; both stages must use the same base (the venv's python
# is a symlink to the base image's interpreter).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: install the locked set into /opt/venv ------------------------------
FROM ${PYTHON_IMAGE} AS build
# uv from PyPI, pinned by hash; it installs every package at uv.lock's version and hash
# (docs/development.md). Bytecode compiled now: the container's root is read-only.
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    UV_PROJECT_ENVIRONMENT=/opt/venv \
    UV_PYTHON_DOWNLOADS=never \
    UV_COMPILE_BYTECODE=1 \
    UV_SYSTEM_CERTS=1 \
    UV_NO_CACHE=1
WORKDIR /app
COPY requirements-uv.txt ./
RUN python -m venv /opt/uv \
 && /opt/uv/bin/pip install --no-cache-dir --require-hashes -r requirements-uv.txt
# src/darkroom/store/schema.sql is a symlink to ../../../schema.sql: keep the same layout
# (/app/schema.sql next to /app/src) so hatchling can follow it into the wheel.
COPY pyproject.toml uv.lock README.md schema.sql ./
COPY src ./src
# --locked: a lock that pyproject.toml outgrew fails the build; --no-editable: the venv is
# self-contained and /app/src is not needed later; no dependency group (tests, bench);
# --extra tracing: the OpenTelemetry SDK and exporter, imported only when an OTLP endpoint is set.
# Every dependency ships wheels; there is no compiler here, so an sdist fails loudly.
RUN /opt/uv/bin/uv sync --locked --no-dev --no-editable --extra tracing --python python3 \
 && /opt/venv/bin/python -c "import importlib.resources as r, pyvips, pi_heif; \
assert r.files('darkroom.store').joinpath('schema.sql').is_file(), 'schema.sql not packaged'"
ENV PATH=/opt/venv/bin:$PATH
# the start-up self-check on the built-in samples: every format works in this image
RUN darkroom check

# ---- runtime ------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
# Fixed uid/gid so volume ownership and Kubernetes runAsUser are predictable;
# --no-log-init avoids a large lastlog entry for the high uid.
RUN groupadd --gid 10001 darkroom \
 && useradd --no-log-init --uid 10001 --gid darkroom --home-dir /app \
      --no-create-home --shell /usr/sbin/nologin darkroom
COPY --from=build /opt/venv /opt/venv
WORKDIR /app
# The only writable place: the default DARKROOM_STORAGE_URL=file:./var/storage
# lands here (mount a volume on /app/var to keep it).
RUN mkdir var && chown darkroom:darkroom var
# MALLOC_ARENA_MAX=2: glibc's per-thread arenas fragment badly under libvips'
# thread pool and make RSS grow without bound.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    MALLOC_ARENA_MAX=2 \
    DARKROOM_METRICS_PORT=9100
# Numeric form of "darkroom", so Kubernetes runAsNonRoot can verify it.
USER 10001:10001
# Prometheus /metrics and /livez.
EXPOSE 9100
# The worker handles SIGTERM itself: stop reading, finish or hand back in-flight
# jobs within DARKROOM_SHUTDOWN_GRACE_S. Give the container a longer stop timeout.
STOPSIGNAL SIGTERM
# No curl in slim: stdlib urllib; any error or HTTP status >= 400 exits non-zero.
# (If DARKROOM_METRICS_PORT=0 disables the server, disable this check too.)
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/livez' % os.environ.get('DARKROOM_METRICS_PORT', '9100'), timeout=3)"]
# Exec form: darkroom runs as the container's main process and gets signals directly.
ENTRYPOINT ["darkroom"]
CMD ["run"]
