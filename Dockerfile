# syntax=docker/dockerfile:1
# torchspot images. Build the trainer (what runs in a worker pod) with:
#   docker build --target trainer -t torchspot-trainer .
# The operator target arrives with the operator issue.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- build: one wheel of the torchspot distribution -------------------------------
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
# torchspot/ holds symlinks to these three folders; copy them all so they resolve.
COPY torchspot ./torchspot
COPY trainer ./trainer
COPY operator ./operator
COPY lab ./lab
RUN pip wheel --no-deps --wheel-dir /wheels .

# --- trainer: torchspot-run plus the training program -----------------------------
FROM ${PYTHON_IMAGE} AS trainer
# The rendezvous handler relies on torch 2.13.0 internals: keep this pin in step with
# pyproject.toml. PyPI's Linux wheel of torch bundles the CUDA and NCCL libraries, so
# the same image trains with NCCL on GPU nodes and gloo on CPU.
ARG TORCH_VERSION=2.13.0
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}"
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl \
    && rm -rf /wheels \
    && useradd --uid 10001 --create-home --shell /usr/sbin/nologin trainer
USER 10001
WORKDIR /home/trainer
ENTRYPOINT ["torchspot-run"]
