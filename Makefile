# `make run` and `make test` set themselves up on a machine with only Python:
# each creates .venv when it is missing and installs the project into it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test test-all test-floor flax-tests sanitize fuzz mutation lint bench clean

run: $(VENV)/.installed
	$(BIN)/nanoattn audit

# Both cores; the few cases marked slow run with `make test-all`.
test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -n 2 --dist worksteal -m "not slow"

test-all: $(VENV)/.installed-test
	$(BIN)/python -m pytest -n 2 --dist worksteal

# The fast part of the suite against the oldest versions nanoattn supports, in .venv-floor:
# exactly pyproject.toml's floors, which the first step checks. flax 0.12.8 is the first
# whose nnx.MultiHeadAttention takes is_causal (nanoattn's flax adapter and its tests pass
# it), and it needs jax>=0.10.0, which needs jaxlib 0.10.0 and numpy>=2.0 (numpy 2.0.0 is
# older than a year, but it is jax's own floor and passes). optax and orbax-checkpoint (test
# extras) are pinned to their newest releases, which accept jax 0.10.0 (>=0.5.3, >=0.6.0).
# Left out, besides the slow cases: the docs' code blocks, the recall example, the bench,
# the fuzz and the hypothesis property tests, which repeat the API use of the rest (a
# renamed file just runs again). 6.5 CPU-minutes: 9 minutes of wall time on a loaded 2-core
# machine, about 4 on an idle one.
FLOOR_VENV := .venv-floor
FLOOR_BIN := $(FLOOR_VENV)/bin
FLOOR_PINS := jax==0.10.0 jaxlib==0.10.0 flax==0.12.8 numpy==2.0.0 \
	optax==0.2.8 orbax-checkpoint==0.12.8
FLOOR_SKIP := test_docs.py or test_example_recall.py or test_bench.py or test_fuzz.py \
	or test_properties.py
test-floor: $(FLOOR_VENV)/.installed-floor
	$(FLOOR_BIN)/python -c 'import importlib.metadata as md, tomllib; \
	deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]; \
	floors = [d.split(">=") for d in deps]; \
	bad = [f"{n} {md.version(n)}, not {v}" for n, v in floors if md.version(n) != v]; \
	print("floors:", *(f"{n}=={md.version(n)}" for n, _ in floors)); \
	raise SystemExit(f"not the floors in pyproject.toml: {bad}" if bad else 0)'
	$(FLOOR_BIN)/python -m pytest -n 2 --dist worksteal -m "not slow" -k "not ($(FLOOR_SKIP))"

# flax's own attention tests with nanoattn.flax_attention_fn as the default attention_fn of
# flax's layers (downloads flax's sdist into .cache/flax-sdist once; about 3 minutes).
flax-tests: $(VENV)/.installed-test
	$(BIN)/python tests/interop/flax_upstream/run.py

# The native kernel built with AddressSanitizer and UndefinedBehaviorSanitizer, and its
# tests and 200 fuzzed native programs (600 calls, tests/test_fuzz.py) run under them (one
# process at a time, about 2 minutes); the sanitized build has its own cache.
SANITIZER_RUNTIMES = $$(g++ -print-file-name=libasan.so) $$(g++ -print-file-name=libubsan.so)
SANITIZE_FUZZ_EXAMPLES ?= 200
sanitize: $(VENV)/.installed-test
	NANOATTN_NATIVE_SANITIZE=address,undefined NANOATTN_CACHE_DIR=.cache/native-sanitize \
	LD_PRELOAD="$(SANITIZER_RUNTIMES)" ASAN_OPTIONS=detect_leaks=0 \
	$(BIN)/python -m pytest -p no:xdist -q tests/backends/test_native.py \
	  tests/backends/test_native_blocks.py tests/backends/test_native_mask_fn.py \
	  tests/backends/test_native_paged.py tests/core/test_paged_attention.py
	NANOATTN_NATIVE_SANITIZE=address,undefined NANOATTN_CACHE_DIR=.cache/native-sanitize \
	LD_PRELOAD="$(SANITIZER_RUNTIMES)" ASAN_OPTIONS=detect_leaks=0 \
	NANOATTN_FUZZ_NATIVE_EXAMPLES=$(SANITIZE_FUZZ_EXAMPLES) \
	$(BIN)/python -m pytest -p no:xdist -q tests/test_fuzz.py -k native

# A long differential-fuzzing campaign (tests/test_fuzz.py, docs/testing.md) in one
# process: fresh examples from FUZZ_SEED, a failure is recorded and the campaign goes
# on, and the summary is printed at the end and written to FUZZ_SUMMARY.
# `make fuzz FUZZ_EXAMPLES=500` for a short one.
FUZZ_EXAMPLES ?= 10000
FUZZ_SEED ?= 0
FUZZ_SUMMARY ?= .hypothesis/fuzz-summary.json
fuzz: $(VENV)/.installed-test
	mkdir -p $(dir $(FUZZ_SUMMARY))
	NANOATTN_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) NANOATTN_FUZZ_SEED=$(FUZZ_SEED) \
	NANOATTN_FUZZ_KEEP_GOING=1 NANOATTN_FUZZ_SUMMARY=$(FUZZ_SUMMARY) \
	$(BIN)/python -m pytest -p no:xdist -q -s tests/test_fuzz.py

# Mutation testing with mutmut (tools/mutation.py, docs/testing.md): each file issue #13
# names is mutated in a scratch copy under .cache/mutation/ and must have at least 90%
# of its mutants killed by the tests that exercise it. Long: about 3 hours on 2 cores
# (flash and verify are most of it). `make mutation MUTATION_TARGETS="masks native"` runs
# some of them; `MUTATION_ARGS="--sample 40 --seed 2"` a seeded sample of each file.
MUTATION_TARGETS ?=
MUTATION_ARGS ?=
mutation: $(VENV)/.installed-mutation
	$(BIN)/python tools/mutation.py $(MUTATION_ARGS) $(MUTATION_TARGETS)

$(VENV)/.installed-mutation: $(VENV)/.installed-test
	$(BIN)/python -m pip install --quiet "mutmut==3.8.1"
	touch $@

lint: $(VENV)/.installed-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@ $(VENV)/.installed

$(FLOOR_VENV)/.installed-floor: pyproject.toml Makefile
	test -x $(FLOOR_BIN)/python || $(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_BIN)/python -m pip install --quiet --upgrade pip
	printf '%s\n' $(FLOOR_PINS) > $(FLOOR_VENV)/floors.txt
	$(FLOOR_BIN)/python -m pip install --quiet -c $(FLOOR_VENV)/floors.txt -e '.[test]'
	touch $@

clean:
	rm -rf $(VENV) $(FLOOR_VENV) build *.egg-info .pytest_cache .ruff_cache
