PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: test test-quick demo bench clean

$(STAMP): requirements.txt pyproject.toml
	python3 -m venv .venv
	.venv/bin/pip install -q -r requirements.txt
	.venv/bin/pip install -q --no-deps dflash==0.1.0
	.venv/bin/pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

test-quick: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

bench: $(STAMP)
	$(PY) bench/loss_memory.py
	$(PY) bench/sampler.py
	$(PY) bench/tree_build.py

clean:
	rm -rf .venv artifacts runs

# The toy world end to end on this machine's CPUs: build, train on 2 ranks, evaluate, plot.
demo: $(STAMP)
	$(PY) data/toy.py
	.venv/bin/deepspeed --num_gpus 2 train.py --cfg configs/toy.yaml
	$(PY) eval/ddtree_accept.py --ckpt runs/toy/checkpoints/latest --bench artifacts/toy/bench.jsonl \
		--budgets 8,32,128 --max-new-tokens 64 --save-samples --out runs/toy/eval.json
	$(PY) eval/plot_run.py runs/toy
