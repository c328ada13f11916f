# syntax=docker/dockerfile:1
# torchspot images, one target each:
#   docker build --target operator -t torchspot-operator .
#   docker build --target trainer  -t torchspot-trainer .
# Without a local Docker engine, Azure Container Registry builds them remotely:
#   az acr build --registry REGISTRY --target operator --image torchspot-operator:0.1.0 .
# Every version is pinned: the Python base by tag, packages in requirements/*.txt, torch
# by TORCH_VERSION. tests/deploy/test_dockerfile.py checks what it can without an engine.

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm
# The trainer's base: a CUDA-enabled PyTorch image by default. Any image with Python
# >= 3.11 works (for example PYTHON_IMAGE for a CPU-only trainer): the trainer stage
# installs torch==TORCH_VERSION from PyPI when the base does not already carry it, and
# PyPI's Linux wheel of torch bundles CUDA and NCCL itself.
ARG TRAINER_BASE=pytorch/pytorch:2.13.0-cuda12.8-cudnn9-runtime

# --- build: one wheel of the torchspot distribution ----------------------------------
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
# The distribution's four source roots (pyproject.toml: packages.find where=...); the operator's
# package carries the CRD as package data.
COPY torchspot ./torchspot
COPY operator/torchspot_operator ./operator/torchspot_operator
COPY trainer/torchspot_trainer ./trainer/torchspot_trainer
COPY lab/torchspot_lab ./lab/torchspot_lab
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# --- operator: the kopf operator, without torch --------------------------------------
FROM ${PYTHON_IMAGE} AS operator
COPY requirements/operator.txt /tmp/requirements.txt
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir -r /tmp/requirements.txt \
    && pip install --no-cache-dir --no-deps /wheels/*.whl \
    && rm -rf /wheels /tmp/requirements.txt \
    && useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin torchspot
# The chart runs it as this user with a read-only root file system.
USER 10001
EXPOSE 8080
ENTRYPOINT ["torchspot-operator"]
CMD ["--standalone", "--all-namespaces", "--liveness=http://0.0.0.0:8080/healthz"]

# --- trainer: torchspot-run plus the training program --------------------------------
FROM ${TRAINER_BASE} AS trainer
# The rendezvous handler relies on torch 2.13.0 internals: keep this pin in step with
# pyproject.toml.
ARG TORCH_VERSION=2.13.0
# --decode gpu decodes JPEGs with nvJPEG through torchvision: the release built for TORCH_VERSION
# (the PyTorch base images carry it already; the `gpu` extra pins the same).
ARG TORCHVISION_VERSION=0.28.0
COPY requirements/trainer.txt /tmp/requirements.txt
COPY --from=build /wheels /wheels
RUN python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '${TORCH_VERSION}')" \
        || pip install --no-cache-dir "torch==${TORCH_VERSION}" \
    && python -c "import torchvision, sys; sys.exit(torchvision.__version__.split('+')[0] != '${TORCHVISION_VERSION}')" \
        || pip install --no-cache-dir --no-deps "torchvision==${TORCHVISION_VERSION}" \
    && pip install --no-cache-dir -r /tmp/requirements.txt \
    && pip install --no-cache-dir --no-deps /wheels/*.whl \
    && rm -rf /wheels /tmp/requirements.txt \
    && useradd --uid 10001 --create-home --shell /usr/sbin/nologin trainer
USER 10001
WORKDIR /home/trainer
ENTRYPOINT ["torchspot-run"]
