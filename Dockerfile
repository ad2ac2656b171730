# GPU image for dpltm: CUDA runtime + torch + the package, installed as a normal (non-editable)
# package with its configs inside it.
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
# Dependencies first (a cached layer: a stub package with the real metadata), then the code.
COPY pyproject.toml README.md ./
RUN mkdir -p dpltm && echo '__version__ = "0"' > dpltm/__init__.py \
    && pip install --no-cache-dir . && pip uninstall -y dpltm && rm -rf dpltm build
COPY dpltm ./dpltm
RUN pip install --no-cache-dir --no-deps . && rm -rf build dpltm

VOLUME ["/data", "/opt/dpltm/checkpoints"]
ENTRYPOINT ["dpltm"]
CMD ["--help"]
