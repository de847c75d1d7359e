# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Both create .venv when missing. Torch: reuse the interpreter's torch when it
# already imports (GPU machines ship one and may have no registry), otherwise
# install torch==2.13.0 pinned -- an unpinned torch pulls GBs of CUDA wheels.
# Reusing: --system-site-packages sees only the base interpreter's packages, so when
# the interpreter is itself a virtual environment (the GPU machines' python3 is), a .pth
# file adds its site-packages too. With no package index, hetstore runs from src/.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test lint format clean bench-deepspeed

# Where .venv's own packages go, and the .pth files that extend it.
VENV_SITE = $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

$(VENV)/.ready: pyproject.toml Makefile
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
		echo "reusing the interpreter's torch"; \
		$(PYTHON) -m venv --system-site-packages $(VENV); \
		$(PYTHON) -c "import sysconfig as s; p = s.get_paths(); print(p['purelib']); print(p['platlib'])" \
			> "$(VENV_SITE)/_interpreter_site.pth"; \
	else \
		$(PYTHON) -m venv $(VENV); \
		$(PY) -m pip install -q --upgrade pip; \
		$(PY) -m pip install -q "torch==2.13.0"; \
	fi
	$(PY) -m pip install -q -e ".[test,demo]" \
		|| $(PY) -m pip install -q --no-build-isolation --no-deps -e . \
		|| { echo "no package index here: hetstore runs from src/ with the interpreter's packages"; \
			echo "$(CURDIR)/src" > "$(VENV_SITE)/_hetstore_src.pth"; }
	$(PY) -c "import torch, hetstore; print('hetstore', hetstore.__version__, 'with torch', torch.__version__)"
	@touch $@

# DeepSpeed (the bench extra), for benchmarks/vs_deepspeed.py and its test. Not fatal:
# without it tests/integration/test_vs_deepspeed_harness.py skips and says why.
$(VENV)/.bench: $(VENV)/.ready
	@if $(PY) -m pip install -q -e ".[bench]"; then touch $@; \
	else echo "deepspeed not installed: tests/integration/test_vs_deepspeed_harness.py will skip"; fi

demo: $(VENV)/.ready
	$(PY) -m hetstore demo --compare

test: $(VENV)/.ready $(VENV)/.bench
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q

# hetstore against DeepSpeed ZeRO-3 offload, side by side: make bench-deepspeed ARGS="--sizes 100M"
bench-deepspeed: $(VENV)/.bench
	$(PY) benchmarks/vs_deepspeed.py $(ARGS)

lint: $(VENV)/.ready
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

clean:
	rm -rf $(VENV)
