# Pagoda on the CPU: the Bazel-built CPU wheel (cp311, as the CI machine
# builds it) on Debian 12's Python 3.11. From the repository root:
#   tools/bazel build //:wheel && mkdir -p dist && cp bazel-bin/wheel/*.whl dist/
#   docker build -f docker/cpu.Dockerfile --build-arg WHEEL=pagoda-0.1.0-cp311-cp311-linux_x86_64.whl -t pagoda:cpu .
FROM python:3.11.7-slim-bookworm

ARG WHEEL
# torch's CPU build (PyPI's x86-64 torch is the CUDA one, gigabytes larger).
ARG PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PAGODA_HOME=/opt/pagoda PAGODA_PORT=8000

COPY docker/pagoda-image.sh requirements-models.txt /opt/pagoda/
COPY dist/${WHEEL} /tmp/
RUN /opt/pagoda/pagoda-image.sh install /tmp/${WHEEL} /opt/pagoda/requirements-models.txt \
    && rm /tmp/${WHEEL} \
    && useradd --create-home --uid 1000 --user-group pagoda

USER 1000
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s \
    CMD ["/opt/pagoda/venv/bin/python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["/opt/pagoda/pagoda-image.sh", "serve"]
