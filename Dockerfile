# GPU image for dpltm: CUDA runtime + the pinned torch build + the package and its configs.
#   docker build -t dpltm .
#   docker run --gpus all -v /path/to/data:/data -v $PWD/checkpoints:/opt/dpltm/checkpoints \
#       dpltm generate --dataset kmnist --split test --device cuda
FROM nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-pip \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/dpltm
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    DPLTM_DATA_DIR=/data \
    PYTHONUNBUFFERED=1
# Dependencies first (cached layer), then the code.
COPY pyproject.toml README.md ./
COPY dpltm/__init__.py dpltm/__init__.py
RUN pip install --no-cache-dir -e . && pip uninstall -y dpltm
COPY dpltm ./dpltm
COPY configs ./configs
RUN pip install --no-cache-dir --no-deps -e .

VOLUME ["/data", "/opt/dpltm/checkpoints"]
ENTRYPOINT ["dpltm"]
CMD ["--help"]
