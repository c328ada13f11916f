# syntax=docker/dockerfile:1
# torchspot images. Build the trainer (what runs in a worker pod) with:
#   docker build --target trainer -t torchspot-trainer .
# The trainer's base defaults to a CUDA-enabled PyTorch image; workers pick NCCL on
# GPUs and gloo on CPU with the same code. The operator target arrives with the
# operator issue.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG TRAINER_BASE=pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime

# --- build: one wheel of the torchspot distribution (no torch inside) -------------
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
# torchspot/ holds symlinks to these three folders; copy them all so they resolve.
COPY torchspot ./torchspot
COPY trainer ./trainer
COPY operator ./operator
COPY lab ./lab
RUN pip wheel --no-deps --wheel-dir /wheels .

# --- trainer: torchspot-run plus the training program on a PyTorch base -----------
FROM ${TRAINER_BASE} AS trainer
COPY --from=build /wheels /wheels
# The base image already has torch; install our wheel without letting pip replace it.
RUN pip install --no-cache-dir --no-deps /wheels/*.whl \
    && pip install --no-cache-dir "etcd-sdk-python>=0.0.7" "protobuf>=5" "grpcio>=1.60" "psutil>=5.9" \
    && rm -rf /wheels \
    && useradd --uid 10001 --create-home --shell /usr/sbin/nologin trainer
USER 10001
WORKDIR /home/trainer
ENTRYPOINT ["torchspot-run"]
