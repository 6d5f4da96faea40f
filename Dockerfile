# tiered on the CPU: `docker build -t tiered .` then `docker run -p 8000:8000 tiered`
# (deploy/compose.yaml adds Prometheus scraping /metrics).
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    LMCACHE_TRACK_USAGE=false
WORKDIR /app

# torch from the default index only (as every install here): PyPI's Linux build carries the CUDA
# libraries (several GB), so the same image also runs on a GPU machine.
RUN pip install torch==2.13.0
COPY pyproject.toml README.md ./
COPY tiered ./tiered
RUN pip install . && tiered --version

# Embedded models are made on first use under /models; mount a volume there to keep them, or a
# real checkpoint folder and pass its path as the model.
VOLUME ["/models", "/root/.cache"]
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s \
    CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health').status != 200)"
ENTRYPOINT ["tiered", "serve", "--host", "0.0.0.0", "--port", "8000", "--set", "model.models_dir=/models"]
CMD []
