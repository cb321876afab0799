# Pagoda on NVIDIA GPUs: the CUDA wheel (`--config=cuda`), built against
# torch 2.11.0+cu130 under Python 3.12 (the H200 machine's torch; README:
# Wheels), with that torch on Ubuntu 24.04's Python 3.12 and the CUDA 13.0
# runtime. From the repository root, with the wheel in dist/:
#   docker build -f docker/cuda.Dockerfile --build-arg WHEEL=pagoda-0.1.0-cp312-cp312-linux_x86_64.whl -t pagoda:cuda .
#   docker run --gpus all -p 8000:8000 pagoda:cuda
FROM nvidia/cuda:13.0.0-runtime-ubuntu24.04

ARG WHEEL
# The wheel pins torch==2.11.0; this index has its CUDA 13.0 build.
ARG PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cu130
ENV PIP_NO_CACHE_DIR=1 PAGODA_HOME=/opt/pagoda PAGODA_PORT=8000

# Triton (torch's dependency) compiles kernels at run time with a C compiler.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-venv gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

COPY docker/pagoda-image.sh requirements-models.txt /opt/pagoda/
COPY dist/${WHEEL} /tmp/
RUN PAGODA_PYTHON=python3.12 /opt/pagoda/pagoda-image.sh install /tmp/${WHEEL} /opt/pagoda/requirements-models.txt \
    && rm /tmp/${WHEEL} \
    && useradd --create-home --uid 1001 --user-group pagoda

USER 1001
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=180s \
    CMD ["/opt/pagoda/venv/bin/python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["/opt/pagoda/pagoda-image.sh", "serve"]
