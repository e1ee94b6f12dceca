# The two commands a newcomer needs: `make demo` and `make test`.
PY := .venv/bin/python
PYTEST_ARGS ?=

.PHONY: check-alerts docs setup setup-apiserver setup-k8s setup-prometheus setup-flink setup-image image image-check-arm64 test unit lint demo bench clean lock spark-job flink-job model-soak sanitize kafka-cluster try-pod

setup:
	@bash tools/setup.sh

# ruff, the layering contracts in .importlinter (the product never imports the harness; the pure core no I/O),
# and mypy, strict, on the product package (pyproject.toml [tool.mypy]).
lint: setup
	.venv/bin/ruff check .
	.venv/bin/lint-imports --no-logo
	.venv/bin/mypy

# kube-apiserver and etcd from the Go module proxy (tools/k8s/build.sh; cached in .cache/k8s): all the demo needs.
# Only Go is needed for it, not the virtualenv, so the demo runs it beside `setup` (make -j2 below).
setup-apiserver:
	@bash tools/k8s/build.sh

# ... and kustomize, helm and kube-state-metrics (tools/k8s/tools.sh), which the tests use.
setup-k8s: setup setup-apiserver
	@bash tools/k8s/tools.sh

# prometheus and promtool from the Go module proxy (tools/prometheus/build.sh; cached in .cache/prometheus):
# the alert rules' checks and unit tests, and the real Prometheus that scrapes the exporter in the lab.
setup-prometheus: setup
	@bash tools/prometheus/build.sh

# podman, buildah, runc and mmdebstrap (Debian's), and the stand-in base image the tests build the
# Dockerfile on (tools/image/base.sh; cached in the engine's storage and .cache/image/).
setup-image: setup
	@bash tools/image/setup.sh

# The Dockerfile, built with podman on the stand-in base (tools/image/build.sh); IMAGE names the result.
IMAGE ?= localhost/flow-exporter:dev
image: setup-image
	@bash tools/image/build.sh $(IMAGE)

# The image for arm64 (under qemu-user on amd64) and the compiled-path property tests run inside it; slow,
# not part of `make test` (tools/image/check_arch.sh says what it needs).
image-check-arm64: setup-image
	@ARCH=arm64 bash tools/image/check_arch.sh

# cosign from the Go module proxy (tools/cosign/build.sh; cached in .cache/cosign): the release's signature, and
# the test that checks a release.
.PHONY: setup-cosign release
setup-cosign: setup
	@bash tools/cosign/build.sh

# Every artifact of the release at the checkout's vX.Y.Z tag, built into dist/ from a clone of that commit, signed
# and checked (tools/release/release.sh, devtools/release.py; docs/contributing/releasing.md): wheel and sdist, the
# chart (pushed as OCI when CHART_REGISTRY is set), the image as an OCI archive (amd64; RELEASE_ARM64=1 adds arm64),
# the SBOM, SHA256SUMS and its cosign signature (COSIGN_KEY, else a throwaway key). helm from tools/k8s/tools.sh.
release: setup setup-cosign setup-image
	@bash tools/k8s/tools.sh
	@bash tools/release/release.sh

# PyFlink in its own virtualenv (.venv-flink, from requirements/flink.lock) and the Flink connector jars.
setup-flink: setup
	@bash tools/flink/setup.sh

# Then the unit suite again, on the interpreted build of the Cython-compiled sources (flow_exporter/compiled.py):
# the same source, run as Python (the fused poll and the admission against the pair they stand for, too). Left out
# of this pass only: test_native_hostile, how the compiled build treats objects that are not what it reads (run
# interpreted, Python's own errors), and test_record_bytes, which holds the compiled build to the interpreted one
# (in this pass it would compare the interpreted build with itself).
INTERPRETED_TESTS := tests/unit --ignore=tests/unit/test_native_hostile.py --ignore=tests/unit/test_record_bytes.py
test: setup setup-k8s setup-prometheus setup-flink setup-image setup-cosign lint docs
	$(PY) -m pytest -q $(PYTEST_ARGS)
	FLOW_EXPORTER_INTERPRETED=1 $(PY) -m pytest -q -p no:cacheprovider $(INTERPRETED_TESTS)
	@bash tools/sanitize.sh

# The alert rules' checks as the README gives them: promtool check rules, then the unit tests of every alert
# (tests/promtool/alerts_test.yaml), on the rules without their annotations (tests/support/monitoring.py).
check-alerts: setup setup-prometheus
	$(PY) -m tests.support.monitoring check

# The compiled modules built with ASAN and UBSAN, and their tests run on that build (make test runs it: the
# decoder and the fused poll run without bounds checks; tools/sanitize.sh says what it runs).
sanitize: setup
	@bash tools/sanitize.sh

# A downstream job against the local broker: broker, registry, lab traffic through the exporter
# (SCRAM, registry framing), then the job once over the topic and its three tables printed.
# Against another broker: make spark-job ARGS="--bootstrap-servers host:9092 --topic flows".
# Either way the harness resolves the connector jars (devtools.spark / devtools.flink, Maven, once into
# .cache) and passes them with --jars: the jobs themselves never look into devtools/ or .cache.
spark-job: setup
	$(PY) -m devtools.downstream spark $(ARGS)

flink-job: setup setup-flink
	$(PY) -m devtools.downstream flink $(ARGS)

# The documentation site (mkdocs.yml, docs/), built strictly into site/: a broken link or anchor, a page left out
# of the navigation or a reference page that cannot be generated fails it. The reference pages (settings, metrics,
# record fields) are generated while it builds (devtools/docs_site.py); a test opens the result in Chromium.
docs: setup
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet

# The unit tests only (tests/unit): no root, broker or API server; seconds.
unit: setup
	$(PY) -m pytest -q tests/unit $(PYTEST_ARGS)

# A long random search of the store model (tests/support/model_soak.py): MODEL_EXAMPLES (1,000,000) sequences
# over MODEL_SEEDS (four from the clock), one process per core; a failure is printed shrunk, with its seed.
model-soak: setup
	$(PY) -m tests.support.model_soak

# On a fresh machine the API server's build (CPU) and setup's downloads (network) overlap: -j2 runs them together.
demo:
	@$(MAKE) --no-print-directory -j2 setup setup-apiserver
	$(PY) -m devtools.demo

# The DaemonSet's pod from k8s/ run here under podman, as the pod tests run it, with a local broker and a namespace lab
# sending traffic: its log and its records until Ctrl-C (root; devtools/try_pod.py). The image is IMAGE, built when
# missing (ARGS="--build" rebuilds it). docs/getting-started/without-a-cluster.md.
try-pod: setup setup-image
	$(PY) -m devtools.try_pod --image $(IMAGE) $(ARGS)

# A three-broker KRaft cluster (replication 3, min.insync.replicas 2), each broker in its own network namespace
# (root: namespaces), until Ctrl-C; it prints bootstrap.servers and each broker's namespace, to try failover on.
# Topics: make kafka-cluster ARGS="--topic flows".
kafka-cluster: setup
	$(PY) -m devtools.kafka_cluster serve $(ARGS)

bench: setup setup-flink
	$(PY) -m bench $(BENCH)

clean:
	rm -rf .venv .venv-flink .cache .pytest_cache .ruff_cache build *.egg-info site dist

# One runtime lock per image platform (the Dockerfile picks it by TARGETARCH), the build tools' lock (setuptools
# and Cython, every platform's hashes: the image's build stage and tools/setup.sh), the SBOM generator's lock (the
# image's build stage), and the development lock.
lock:
	$(PY) -m uv pip compile --quiet pyproject.toml -c requirements/constraints.txt --generate-hashes --python-version 3.11 --python-platform x86_64-unknown-linux-gnu -o requirements/runtime.lock
	$(PY) -m uv pip compile --quiet pyproject.toml -c requirements/constraints.txt --generate-hashes --python-version 3.11 --python-platform aarch64-unknown-linux-gnu -o requirements/runtime-arm64.lock
	$(PY) -m uv pip compile --quiet requirements/build.in --generate-hashes --python-version 3.11 --python-platform x86_64-unknown-linux-gnu -o requirements/build.lock
	$(PY) -m uv pip compile --quiet requirements/sbom.in --generate-hashes --python-version 3.11 --python-platform x86_64-unknown-linux-gnu -o requirements/sbom.lock
	$(PY) -m uv pip compile --quiet pyproject.toml -c requirements/constraints.txt --extra dev --extra bench --generate-hashes --python-version 3.11 --python-platform x86_64-unknown-linux-gnu -o requirements/dev.lock
