# The edge: aiohttp, redis, msgspec and friends; no torch, no vLLM. Small, and up in a second.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm
FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
# every package at the lock's version and hash (deploy/lock.py); the layer stays cached until the lock changes
COPY deploy/locks/edge.txt deploy/locks/
RUN pip install --no-deps -r deploy/locks/edge.txt
COPY pyproject.toml README.md ./
COPY shared shared
COPY services services
RUN pip install --no-deps . && useradd --uid 10001 --no-create-home tokenbus
USER 10001
ENV TOKENBUS_HOST=0.0.0.0 TOKENBUS_PORT=8000
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["tokenbus"]
CMD ["edge"]
# checkov:skip=CKV_DOCKER_7: FROM is an ARG whose default is a version tag (checkov does not read ARG defaults)
