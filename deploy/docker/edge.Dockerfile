# The edge: aiohttp, redis, msgspec and friends; no torch, no vLLM. Small, and up in a second.
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared shared
COPY services services
RUN pip install . && useradd --uid 10001 --no-create-home tokenbus
USER 10001
ENV TOKENBUS_HOST=0.0.0.0 TOKENBUS_PORT=8000
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["tokenbus"]
CMD ["edge"]
