PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: test demo bench clean

$(STAMP): requirements.txt pyproject.toml
	python3 -m venv .venv
	.venv/bin/pip install -q -r requirements.txt
	.venv/bin/pip install -q --no-deps dflash==0.1.0
	.venv/bin/pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) bench/loss_memory.py
	$(PY) bench/sampler.py
	$(PY) bench/tree_build.py

clean:
	rm -rf .venv artifacts runs
