# The two commands of README.md, plus the benchmarks. Each one first makes sure the Debian
# packages kvfuse builds with are installed (scripts/deps.sh), then configures, builds, runs.
JOBS ?= $(shell nproc)
CMAKE_COMMON = -DKVFUSE_WERROR=ON
# The llama.cpp integration and kvfuse-llama: off in a plain configure (CMakeLists.txt), on
# here. test-tsan leaves it off: CMakeLists.txt never builds it under ThreadSanitizer.
WITH_LLAMA = -DKVFUSE_BUILD_LLAMA=ON

.PHONY: demo test test-plain test-asan test-tsan bench deps clean

deps:
	@scripts/deps.sh

# The main job: build kvfuse-replay and run it on its default workload (every model, every
# fault, two passes, one process per rank); it prints its report. RANKS_AS=threads runs the
# ranks as threads of the engine's process. Then kvfuse-llama: three llama.cpp models served
# twice, offload off and on, compared bit for bit (apps/llama/, docs/llama.md).
# REPLAY_ARGS and LLAMA_ARGS add options (see --help). OpenMP threads that sleep while they
# wait leave the CPUs to kvfuse's lanes; it changes no result.
REPLAY_ARGS ?=
RANKS_AS ?= processes
LLAMA_ARGS ?=
demo: deps
	cmake -S . -B build/release -DCMAKE_BUILD_TYPE=Release $(CMAKE_COMMON) $(WITH_LLAMA) -DKVFUSE_BUILD_BENCH=OFF
	cmake --build build/release --target kvfuse_replay kvfuse_llama_app -j $(JOBS)
	./build/release/apps/replay/kvfuse-replay --two-pass --ranks-as $(RANKS_AS) $(REPLAY_ARGS)
	OMP_WAIT_POLICY=PASSIVE ./build/release/apps/llama/kvfuse-llama $(LLAMA_ARGS)

# The whole suite: -Werror build + ctest, then again under ASan+UBSan, then the
# multi-threaded tests under ThreadSanitizer.
test: deps test-plain test-asan test-tsan

test-plain:
	cmake -S . -B build/test -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_COMMON) $(WITH_LLAMA) -DKVFUSE_BUILD_BENCH=ON
	cmake --build build/test -j $(JOBS)
	ctest --test-dir build/test --output-on-failure -j $(JOBS)

test-asan:
	cmake -S . -B build/asan -DCMAKE_BUILD_TYPE=Debug $(CMAKE_COMMON) $(WITH_LLAMA) -DKVFUSE_SANITIZE=address,undefined \
	  -DKVFUSE_BUILD_BENCH=OFF -DKVFUSE_BUILD_EXAMPLES=ON -DKVFUSE_BUILD_APPS=ON -DCMAKE_CXX_FLAGS=-O1
	cmake --build build/asan -j $(JOBS)
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --test-dir build/asan --output-on-failure -j $(JOBS)

test-tsan:
	cmake -S . -B build/tsan -DCMAKE_BUILD_TYPE=Debug $(CMAKE_COMMON) -DKVFUSE_SANITIZE=thread \
	  -DKVFUSE_BUILD_BENCH=OFF -DKVFUSE_BUILD_EXAMPLES=ON -DKVFUSE_BUILD_APPS=ON -DCMAKE_CXX_FLAGS=-O1
	cmake --build build/tsan -j $(JOBS)
	TSAN_OPTIONS=halt_on_error=1 ctest --test-dir build/tsan --output-on-failure -j $(JOBS)

# The benchmarks and kvfuse-replay (bench/README.md), then the cache policies against the
# offline reference (bench/cache_policies.py), then llama-server's prompt cache side by side,
# stock against kvfuse (bench/llama_server/; its target builds the tiny models and whichever
# servers are defined), then the plots of all.
bench: deps
	cmake -S . -B build/release -DCMAKE_BUILD_TYPE=Release $(CMAKE_COMMON) $(WITH_LLAMA) -DKVFUSE_BUILD_BENCH=ON
	cmake --build build/release --target kvfuse_benchmarks kvfuse_replay kvfuse_llama_server_bench -j $(JOBS)
	bench/run.sh build/release/bench
	python3 bench/cache_policies.py build/release/apps/replay/kvfuse-replay --out build/bench-results
	bench/llama_server/run.sh build/release
	bench/plot.sh build/bench-results docs/img

clean:
	rm -rf build
