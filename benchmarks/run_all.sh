#!/usr/bin/env bash
# Every figure in benchmarks/RESULTS.md comes from one of these commands (JSON in benchmarks/out/).
# Run on an otherwise idle machine: they measure time. About 25 minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
make venv
T=.venv/bin/tiered
$T bench mil --model embedded:bench --budget 128MiB --skip-throughput --json benchmarks/out/mil-bench-128MiB.json
$T bench mil --model embedded:bench --skip-mil --repeats 3 --json benchmarks/out/speed-bench.json
$T bench mil --model embedded:bench --skip-mil --repeats 3 --lengths 8192 --chunk-tokens 128 --modes vanilla,chunked,hybrid --json benchmarks/out/speed-bench-chunk128.json
$T bench tiers --model embedded:bench --json benchmarks/out/tiers-bench.json
$T bench policies --config configs/bench.yaml --json benchmarks/out/policies-bench.json
$T bench policies --config configs/bench.yaml --load 0 --json benchmarks/out/policies-burst.json
$T bench server --json benchmarks/out/server-overhead.json
