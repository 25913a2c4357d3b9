# The two commands of the README:  `make demo`  and  `make test`.
# Each creates .venv and installs everything on first use.
# TORCH_SPEC picks the torch build: the default is the CPU build this kind of machine carries;
# on a GPU machine use e.g. `make test TORCH_SPEC=torch`.
# `make test` ends with the floor job: the same checks on the oldest stack pyproject.toml declares
# (torch, diffusers, transformers, accelerate pinned at their floors by .ci/floor_versions.py), in
# its own .venv-floor (torch from PyPI: a CUDA build, ~4 GB once); `make test FLOOR=` skips it.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
FLOOR_VENV := .venv-floor
FLOOR_STAMP := $(FLOOR_VENV)/.installed
FLOOR ?= floor
# what the floor job runs: the declared-versions checks and the suites that run there in a few minutes. The
# whole suite passes or skips by feature on the floor (diffusion_debug/testing/features.py) but takes ~20 min
# with -n 2 on 2 cores: left out are the multi-process launches, the compile tests and the benchmarks.
FLOOR_TESTS ?= tests/test_declared_versions.py tests/test_stats.py tests/test_record.py tests/test_probe_techniques.py tests/test_op_count.py \
	tests/test_probes.py tests/test_doctests.py tests/testing/test_pipelines.py tests/toolkit/test_inspect_model.py \
	tests/diffusion/test_localize.py tests/diffusion/test_true_origins.py tests/diffusion/test_checks.py \
	tests/diffusion/test_blackouts.py tests/diffusion/test_inference_mode.py tests/diffusion/test_call_sites.py \
	tests/diffusion/test_debugger_policy.py tests/diffusion/test_pipeline_patches.py tests/diffusion/test_out_of_memory.py \
	tests/diffusion/test_debugger.py tests/diffusion/test_fp16_probes.py tests/diffusion/test_pipeline_zoo.py \
	tests/diffusion/test_why.py tests/diffusion/test_tree_memo.py tests/diffusion/test_patch_seams.py \
	tests/diffusion/test_cache_hooks.py tests/diffusion/test_modular.py tests/diffusion/test_experts.py \
	tests/diffusion/test_text_diffusion.py tests/diffusion/test_causal_cache_vae.py \
	tests/training/test_gradients.py tests/training/test_loss.py tests/training/test_stalls.py \
	tests/training/test_watched_models.py tests/training/test_causes.py tests/training/test_training_debugger.py \
	tests/training/test_pre_reduction.py tests/training/test_shared_clip.py tests/jobs/test_finetune.py tests/jobs/test_profile.py tests/jobs/test_launch_inputs.py \
	tests/training/test_several_optimizers.py tests/training/test_scaler_not_passed.py \
	tests/training/test_scaler_not_passed_rows.py tests/training/test_every_step_skipped.py tests/training/test_applied_update.py \
	tests/training/test_rank_summary.py tests/training/test_sync_off.py tests/training/test_training_checks.py \
	tests/training/test_anomaly_mode.py tests/training/test_step_row.py tests/training/test_module_health.py \
	tests/diffusion/test_fp16_autocast.py tests/diffusion/test_fp16_autocast_replays.py tests/diffusion/test_near_max_origins.py \
	tests/diffusion/test_second_origins.py

.PHONY: demo test bench bench-user-path setup floor

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	DS_BUILD_OPS=0 $(BIN)/python -m pip install --quiet --no-build-isolation deepspeed \
		|| echo "deepspeed did not install: the DeepSpeed tests skip"
	touch $(STAMP)

$(FLOOR_STAMP): pyproject.toml .ci/floor_versions.py
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(FLOOR_VENV)/bin/python -m pip install --quiet $$($(PYTHON) .ci/floor_versions.py) -e ".[test]"
	touch $(FLOOR_STAMP)

demo: $(STAMP)
	$(BIN)/diffusion-debug demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	@# bytecode written once: where PYTHONDONTWRITEBYTECODE is set, each launched rank compiled the package anew
	$(BIN)/python -m compileall -q diffusion_debug
	$(BIN)/python -m pytest -n 2 --dist loadgroup
	$(if $(FLOOR),$(MAKE) --no-print-directory $(FLOOR))

floor: $(FLOOR_STAMP)
	$(FLOOR_VENV)/bin/python -c "import torch, diffusers, transformers, accelerate as a; \
		print('floor job: torch', torch.__version__, 'diffusers', diffusers.__version__, \
		'transformers', transformers.__version__, 'accelerate', a.__version__)"
	$(FLOOR_VENV)/bin/python -m pytest -n 2 --dist loadgroup $(FLOOR_TESTS)

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run

# the fp16/bf16 rows alone (issue 45), a few minutes: the 1-step fixed cost, the SD1.5-shaped proxy's
# feature table and component split, the counts per dtype
bench-user-path: $(STAMP)
	$(BIN)/python -m benchmarks.user_path
