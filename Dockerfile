# GPU image for dpltm. The torch wheel bundles its CUDA libraries, so a slim Python base is enough;
# `docker run --gpus all` provides the driver. dpltm is installed as a normal (non-editable) package
# by docker/install.sh, the same script CI runs outside Docker (.ci/run), and runs as a non-root user.
#   docker build -t dpltm .
#   docker run --gpus all -v /path/to/data:/data -v $PWD/checkpoints:/work/checkpoints dpltm run --device cuda
#   docker run --gpus all -v /path/to/data:/data -v $PWD/checkpoints:/work/checkpoints dpltm \
#       generate --dataset kmnist --split test --device cuda
FROM python:3.12-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DPLTM_DATA_DIR=/data \
    PATH=/opt/venv/bin:$PATH

COPY pyproject.toml README.md constraints.txt /src/
COPY dpltm /src/dpltm
COPY configs /src/configs
COPY docker/install.sh /src/docker/install.sh
RUN DPLTM_PIP_OPTIONS="-c /src/constraints.txt" bash /src/docker/install.sh /opt/venv /src && rm -rf /src \
    && useradd --create-home --uid 1000 dpltm \
    && mkdir -p /data /work/checkpoints /work/logs && chown dpltm:dpltm /work /work/checkpoints /work/logs

USER dpltm
WORKDIR /work
# data (read-only is fine) and outputs (checkpoints/ under the working directory) are volumes
VOLUME ["/data", "/work/checkpoints", "/work/logs"]
ENTRYPOINT ["dpltm"]
CMD ["--help"]
