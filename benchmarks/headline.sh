#!/usr/bin/env bash
# Every JSON in benchmarks/results/ (the generated table at the top of RESULTS.md) comes from one of
# these commands; then `python -m benchmarks report` rewrites the tables. Run on an otherwise idle machine:
# they measure time (about an hour on 2 CPU cores). The peer needs `make bench-env`.
set -euo pipefail
cd "$(dirname "$0")/.."
make venv bench-env
B=".venv/bin/python -m benchmarks"
R=benchmarks/results
# Visits at saturation and at 0.5x / 0.8x of vLLM's saturation rate, against vLLM at its best.
$B visits --config configs/bench-m.yaml --users 16 --visits 24 --posts 8 --systems tiered,vllm \
  --multiples 0.5,0.8 --load-of vllm --repeats 3 --warm-up-visits 4 --json $R/visits-bench-m.json \
  --plots benchmarks/out/visits-bench-m
# The same again with the current engine, at 0.5x, 0.8x and 1x of vLLM's saturation rate.
$B visits --config configs/bench-m.yaml --users 16 --visits 24 --posts 8 --systems tiered,vllm \
  --multiples 0.5,0.8,1 --load-of vllm --repeats 3 --warm-up-visits 4 --json $R/visits-bench-m-loads.json \
  --plots benchmarks/out/visits-bench-m-loads
# The same at saturation against vLLM with our device tier's KV only, and against vLLM eager.
$B visits --config configs/bench-m.yaml --users 16 --visits 24 --posts 8 \
  --systems tiered,vllm-devkv,vllm-eager --multiples '' --repeats 3 --warm-up-visits 4 \
  --json $R/visits-bench-m-devkv-eager.json --plots benchmarks/out/visits-bench-m-devkv-eager
# A lone uncached 8 K prompt (credit verification).
$B alone --config configs/bench-m.yaml --tokens 8192 --systems tiered,vllm --repeats 3 \
  --json $R/alone-bench-m-8k.json
# KV beyond memory: 40 users (Zipf 0.5, most visits returning), 96 MiB of KV for both (ours: 32 MiB
# device + 64 MiB host memory, then a local disk tier; vLLM: 96 MiB of KV blocks), ~5x the budget.
rm -rf /tmp/tiered-disk
$B visits --config configs/bench-m.yaml --users 40 --zipf 0.5 --visits 96 --posts 8 \
  --set model.max_model_len=4096 --set cache.device_tier_bytes=33554432 \
  --set 'cache.host.lmcache={max_local_cpu_size: 0.0625, local_disk: "/tmp/tiered-disk", max_local_disk_size: 8}' \
  --systems tiered,vllm --multiples '' --repeats 3 --warm-up-visits 4 \
  --json $R/visits-beyond-memory-bench-m.json --plots benchmarks/out/visits-beyond-memory
# KV beyond memory with 4,000-token profiles: 24 users (~7.7x a 96 MiB budget: 64 MiB device + 32 MiB
# host memory, then a local disk tier; vLLM: 96 MiB of KV blocks), at saturation and at 0.5x / 0.8x
# of vLLM's saturation; then 12 and 48 users, one run pair each, for the plot of visits/s against
# the profiles' KV.
V4K="--config configs/bench-m.yaml --zipf 0.5 --profile-tokens 4000 --profile-sd 500
  --profile-min 3000 --profile-max 5000 --set model.max_model_len=8192 --set cache.device_tier_bytes=67108864"
DISK='cache.host.lmcache={max_local_cpu_size: 0.03125, local_disk: "/tmp/tiered-disk", max_local_disk_size: 8}'
rm -rf /tmp/tiered-disk
$B visits $V4K --users 24 --visits 100 --posts 8 --set "$DISK" --systems tiered,vllm --multiples 0.5,0.8 --load-of vllm \
  --repeats 3 --json $R/visits-beyond-memory-4k-bench-m.json --plots benchmarks/out/visits-beyond-memory-4k
for users in 12 48; do
  rm -rf /tmp/tiered-disk
  $B visits $V4K --users $users --visits 100 --posts 8 --set "$DISK" --systems tiered,vllm --multiples '' --repeats 1 \
    --json benchmarks/out/visits-beyond-memory-4k-users$users.json --plots benchmarks/out/visits-beyond-memory-4k-$users
done
# A feed: 32 users, 240 visits of 2 posts (most of them returning users'), profiles ~10x the budget.
rm -rf /tmp/tiered-disk
$B visits $V4K --users 32 --visits 240 --posts 2 --set "$DISK" --systems tiered,vllm --multiples '' --repeats 3 \
  --json $R/visits-beyond-memory-feed-bench-m.json --plots benchmarks/out/visits-beyond-memory-feed
$B plot-working-set benchmarks/out/visits-beyond-memory-4k-users12.json $R/visits-beyond-memory-4k-bench-m.json \
  benchmarks/out/visits-beyond-memory-4k-users48.json --out benchmarks/plots/visits-beyond-memory-4k.png
# The longest prompt each engine serves within a memory budget (weights + activations + KV).
$B longest --config configs/bench-m.yaml --budgets 320MiB,448MiB --json $R/longest-bench-m.json \
  --plot benchmarks/plots/longest-bench-m.png
# A prefix loaded from the host tier's memory and from its disk alone (page cache dropped) against recompute.
rm -rf /tmp/tiers-disk
$B tiers --model embedded:bench-m --lengths 1792,8192 --repeats 3 --disk /tmp/tiers-disk --users 2 --rounds 2 \
  --profile-tokens 1792 --sequence-repeats 1 --json $R/tiers-disk-bench-m.json
# A revisit sequence, one request at a time: the host tier (offload) against PrefillOnly's discard.
$B tiers --model embedded:bench-m --sequence-repeats 3 --json $R/tiers-bench-m.json
# Short calls among 16 K prompts: vLLM's sweep, one run each beside ours (data, not table rows: n = 1).
M="--config configs/bench-m.yaml --long-tokens 16384 --long-per-minute 0.5 --long-slo-ms 180000 --short-slo-ms 5000"
$B mixed $M --minutes 2 --short-qps 0.25 --alone-repeats 1 --repeats 1 \
  --systems tiered,vllm-chunk2048,vllm-chunk1024-cap256,vllm-priority-chunk2048-cap512 \
  --json $R/mixed-bench-m-16k-sweep.json --plots benchmarks/out/mixed-16k-sweep
# The same sweep at a second load, 1 short call/s (near our capacity at these objectives).
$B mixed $M --minutes 2 --short-qps 1 --alone-repeats 1 --repeats 1 \
  --systems tiered,vllm-chunk2048,vllm-priority-chunk1024-cap256,vllm-priority-chunk2048-cap512 \
  --json $R/mixed-bench-m-16k-sweep-1qps.json --plots benchmarks/out/mixed-16k-sweep-1qps
# The sweep's best vLLM setting (most short calls in time), repeated: the table's 16 K row.
$B mixed $M --minutes 2 --short-qps 0.25 --alone-repeats 1 --repeats 3 \
  --systems tiered,vllm-priority-chunk2048-cap512 \
  --json $R/mixed-bench-m-16k.json --plots benchmarks/out/mixed-16k
# The same 8 K prompt on the AMX Xeon (run there: its rows name that machine).
$B alone --config configs/bench-m.yaml --tokens 8192 --systems tiered,vllm --repeats 3 --json $R/alone-bench-m-8k-amx.json
# Short calls among 16 K prompts at heavier loads (the AMX Xeon's rows).
M2="--config configs/bench-m.yaml --long-tokens 16384 --long-per-minute 4 --long-slo-ms 60000 --short-slo-ms 2000"
$B mixed $M --minutes 2 --short-qps 0.25 --alone-repeats 1 --repeats 3 --systems tiered,vllm-priority-chunk2048-cap512 \
  --json $R/mixed-bench-m-16k-amx-light.json --plots benchmarks/out/mixed-16k-amx-light
$B mixed $M2 --minutes 2 --short-qps 1.0 --alone-repeats 1 --repeats 3 --systems tiered,vllm-priority-chunk2048-cap512 \
  --json $R/mixed-bench-m-16k-amx.json --plots benchmarks/out/mixed-16k-amx
$B mixed $M2 --minutes 2 --short-qps 5,7 --alone-repeats 1 --repeats 3 \
  --systems tiered,vllm-priority-chunk2048-cap512,tiered-in-order \
  --json $R/mixed-bench-m-16k-overload.json --plots benchmarks/out/mixed-16k-overload
# Short calls among 16 K prompts at 1 short call/s on the 2-core EPYC (near its capacity): calls predicted to
# miss their objective refused at once (scheduler.late: shed), vLLM given each call's deadline as its priority.
$B mixed $M --minutes 2 --short-qps 1 --alone-repeats 1 --repeats 3 --systems tiered,vllm-priority-chunk2048-cap512 \
  --json $R/mixed-bench-m-16k-shed.json --plots benchmarks/out/mixed-16k-shed
# Capacity at the objectives on the 2-core EPYC: the light setting's objectives at 5 loads, 3 pairs each.
$B mixed $M --minutes 2 --short-qps 0.25,0.5,0.75,1,1.25 --alone-repeats 1 --repeats 3 \
  --systems tiered,vllm-priority-chunk2048-cap512 --json $R/mixed-bench-m-16k-capacity.json \
  --plots benchmarks/out/mixed-16k-capacity
$B plot-mixed $R/mixed-bench-m-16k-capacity.json --out benchmarks/plots/mixed-bench-m-16k-capacity.png
# Capacity at the heavier objectives on the AMX Xeon (run there: its rows name that machine), 5 loads, 3 pairs each.
$B mixed $M2 --minutes 2 --short-qps 1,3,5,7,9 --alone-repeats 1 --repeats 3 \
  --systems tiered,vllm-priority-chunk2048-cap512 --json $R/mixed-bench-m-16k-xeon-capacity.json \
  --plots benchmarks/out/mixed-16k-xeon-capacity
$B plot-mixed $R/mixed-bench-m-16k-xeon-capacity.json --out benchmarks/plots/mixed-bench-m-16k-xeon-capacity.png
# The same on the AMX Xeon after the pieces' attention and the long prompts' room to yield changed: 4 loads, 2 pairs
# each; the first version of the room rule (`tiered`, engine a3d0f0a) against the engine before it (74a2198 checked
# out at /tmp/base) at 7 and 9/s.
$B mixed $M2 --minutes 2 --short-qps 3,5,7,9 --alone-repeats 1 --repeats 2 \
  --systems tiered,vllm-priority-chunk2048-cap512 --json $R/mixed-bench-m-16k-xeon-pieces.json \
  --plots benchmarks/out/mixed-16k-xeon-pieces
$B plot-mixed $R/mixed-bench-m-16k-xeon-pieces.json --out benchmarks/plots/mixed-bench-m-16k-xeon-pieces.png
# The 5-load capacity sweep again on the AMX Xeon with that engine (5ec97ba), 3 pairs a load; then ours alone at 5, 7
# and 9/s with shed calls timed (tiered:shed_delay_seconds), run with engine d0663dd and again with 5bfd7c7 (the
# second run written beside the first, its name dated).
$B mixed $M2 --minutes 2 --short-qps 1,3,5,7,9 --alone-repeats 1 --repeats 3 \
  --systems tiered,vllm-priority-chunk2048-cap512 --json $R/mixed-bench-m-16k-xeon-capacity-pieces.json \
  --plots benchmarks/out/mixed-16k-xeon-capacity-pieces
$B plot-mixed $R/mixed-bench-m-16k-xeon-capacity-pieces.json \
  --out benchmarks/plots/mixed-bench-m-16k-xeon-capacity-pieces.png
$B mixed $M2 --minutes 2 --short-qps 5,7,9 --alone-repeats 1 --repeats 1 --systems tiered \
  --json $R/mixed-bench-m-16k-xeon-shed-delay.json --plots benchmarks/out/mixed-16k-xeon-shed-delay
$B mixed $M2 --minutes 2 --short-qps 7,9 --alone-repeats 1 --repeats 2 \
  --systems tiered,tiered-base,vllm-priority-chunk2048-cap512 --base-tree /tmp/base \
  --json $R/mixed-bench-m-16k-xeon-longs.json --plots benchmarks/out/mixed-16k-xeon-longs
# vLLM's settings on the AMX Xeon at two loads, one run each (its servers only).
$B mixed $M2 --minutes 2 --short-qps 3,7 --alone-repeats 1 --repeats 1 \
  --systems vllm-priority-chunk2048-cap512,vllm-priority-chunk1024-cap256,vllm-priority-chunk4096-cap1024 \
  --json $R/mixed-bench-m-16k-xeon-vllm-sweep.json --plots benchmarks/out/mixed-16k-xeon-vllm-sweep
# The native attention kernel on long prefixes, before (tiered/native/csrc of 3436b59 in a worktree at /tmp/kbase) and
# after, in ABAB order.
for i in 1 2; do
  (cd /tmp/kbase && PYTHONPATH=. $OLDPWD/.venv/bin/python -m benchmarks attention --kernels native --max-tokens 17664 \
    --json $OLDPWD/$R/attention-xeon-long-prefix-before-$i.json)
  $B attention --kernels native --max-tokens 17664 --json $R/attention-xeon-long-prefix-after-$i.json
done
# KV beyond memory with 4,000-token profiles again (24 users, 100 visits), and a feed of 240 visits of 8 posts.
rm -rf /tmp/tiered-disk
$B visits $V4K --users 24 --visits 100 --posts 8 --set "$DISK" --systems tiered,vllm --multiples '' --repeats 3 \
  --json $R/visits-beyond-memory-4k-rerun-bench-m.json --plots benchmarks/out/visits-beyond-memory-4k-rerun
rm -rf /tmp/tiered-disk
$B visits $V4K --users 24 --visits 240 --posts 8 --set "$DISK" --systems tiered,vllm --multiples '' --repeats 3 \
  --json $R/visits-beyond-memory-feed8-bench-m.json --plots benchmarks/out/visits-beyond-memory-feed8
# KV beyond memory against the peer with our tiers (vLLM + LMCache's server: vLLM's KV = our device tier,
# LMCache's L1 = our host memory, an fs L2 beside our disk tier) and against plain vLLM (KV = both our memory
# tiers), every system's processes in a 4 GiB memory cgroup (page cache included; needs root).
rm -rf /tmp/tiered-disk
$B visits $V4K --users 32 --visits 80 --posts 8 \
  --set 'cache.host.lmcache={max_local_cpu_size: 0.25, local_disk: "/tmp/tiered-disk", max_local_disk_size: 8}' \
  --systems tiered,vllm-lmcache,vllm --multiples '' --repeats 3 --memory-limit 4GiB \
  --json $R/visits-beyond-memory-lmcache-bench-m.json --plots benchmarks/out/visits-beyond-memory-lmcache
# The 2-post feed beyond memory against both peers under the same 4 GiB limit: 32 users, 160 visits of 2 posts.
rm -rf /tmp/tiered-disk
$B visits $V4K --users 32 --visits 160 --posts 2 \
  --set 'cache.host.lmcache={max_local_cpu_size: 0.25, local_disk: "/tmp/tiered-disk", max_local_disk_size: 8}' \
  --systems tiered,vllm-lmcache,vllm --multiples '' --repeats 3 --memory-limit 4GiB \
  --json $R/visits-beyond-memory-lmcache-feed2-bench-m.json --plots benchmarks/out/visits-beyond-memory-lmcache-feed2
# The 100-visit trace (24 users, 8 posts a visit) against both peers under the same 4 GiB limit.
rm -rf /tmp/tiered-disk
$B visits $V4K --users 24 --visits 100 --posts 8 \
  --set 'cache.host.lmcache={max_local_cpu_size: 0.25, local_disk: "/tmp/tiered-disk", max_local_disk_size: 8}' \
  --systems tiered,vllm-lmcache,vllm --multiples '' --repeats 3 --memory-limit 4GiB \
  --json $R/visits-beyond-memory-lmcache-trace100-bench-m.json --plots benchmarks/out/visits-beyond-memory-lmcache-trace100
# The 8-post feed (24 users, 240 visits) under the same 4 GiB limit, against plain vLLM (vLLM + LMCache's worker
# was killed at that limit on this feed).
rm -rf /tmp/tiered-disk
$B visits $V4K --users 24 --visits 240 --posts 8 \
  --set 'cache.host.lmcache={max_local_cpu_size: 0.25, local_disk: "/tmp/tiered-disk", max_local_disk_size: 8}' \
  --systems tiered,vllm --multiples '' --repeats 3 --memory-limit 4GiB \
  --json $R/visits-beyond-memory-4g-feed8-bench-m.json --plots benchmarks/out/visits-beyond-memory-4g-feed8
# The same feed against vLLM + LMCache under a 6 GiB limit each (run on the AMX Xeon).
rm -rf /tmp/tiered-disk
$B visits $V4K --users 24 --visits 240 --posts 8 \
  --set 'cache.host.lmcache={max_local_cpu_size: 0.25, local_disk: "/tmp/tiered-disk", max_local_disk_size: 8}' \
  --systems tiered,vllm-lmcache --multiples '' --repeats 3 --memory-limit 6GiB \
  --json $R/visits-beyond-memory-6g-feed8-lmcache-bench-m.json --plots benchmarks/out/visits-beyond-memory-6g-feed8-lmcache
# Its latency below saturation: 24 users, 32 visits of 2 posts, at 0.8x plain vLLM's saturation (the better peer).
rm -rf /tmp/tiered-disk
$B visits $V4K --users 24 --visits 32 --posts 2 \
  --set 'cache.host.lmcache={max_local_cpu_size: 0.25, local_disk: "/tmp/tiered-disk", max_local_disk_size: 8}' \
  --systems tiered,vllm --multiples 0.8 --load-of vllm --repeats 3 --memory-limit 4GiB \
  --json $R/visits-beyond-memory-lmcache-feed2-load-bench-m.json --plots benchmarks/out/visits-beyond-memory-lmcache-feed2-load
# The same trace against both peers at saturation and at 0.5x / 0.8x of plain vLLM's saturation.
rm -rf /tmp/tiered-disk
$B visits $V4K --users 24 --visits 32 --posts 2 \
  --set 'cache.host.lmcache={max_local_cpu_size: 0.25, local_disk: "/tmp/tiered-disk", max_local_disk_size: 8}' \
  --systems tiered,vllm-lmcache,vllm --multiples 0.5,0.8 --load-of vllm --repeats 3 --memory-limit 4GiB \
  --json $R/visits-beyond-memory-lmcache-feed2-loads-bench-m.json --plots benchmarks/out/feed2-loads
# The same pair at a 6 GiB limit, one run each (data, not a table row: was 4 GiB too tight for the peer?).
rm -rf /tmp/tiered-disk
$B visits $V4K --users 32 --visits 80 --posts 8 \
  --set 'cache.host.lmcache={max_local_cpu_size: 0.25, local_disk: "/tmp/tiered-disk", max_local_disk_size: 8}' \
  --systems tiered,vllm-lmcache --multiples '' --repeats 1 --memory-limit 6GiB \
  --json $R/visits-beyond-memory-lmcache-6g-bench-m.json --plots benchmarks/out/visits-beyond-memory-lmcache-6g
# The longest prompt answered under the same memory: vLLM first (KV = budget - weights, its peak measured in a
# cgroup), then ours in a cgroup of vLLM's peak, held to 5x vLLM's length (our longest at 512 MiB takes an hour here).
rm -rf /tmp/tiered-spill
$B longest --config configs/bench-m.yaml --budgets 320MiB,512MiB --resolution 128 \
  --set model.path=embedded:bench-m-1m --set forward.chunk_tokens=512 --set forward.spill_dir=/tmp/tiered-spill \
  --set attention.kernel=native --answer-max-tokens 1048576 --memory-limit peer --ours-max-tokens 5x \
  --out-dir benchmarks/out/longest-cgroup --json $R/longest-cgroup-bench-m.json \
  --plot benchmarks/plots/longest-cgroup-bench-m.png
# A reranking service on a Qwen3 checkpoint of bench-m's size: vLLM serving it as Qwen3-Reranker.
$B rerank --config configs/bench-m.yaml --set model.path=embedded:bench-m-qwen3 --calls 8 --documents 50 \
  --doc-tokens 200,300 --multiples 0.8 --repeats 3 --json $R/rerank-bench-m-qwen3.json
$B rerank --config configs/bench-m.yaml --set model.path=embedded:bench-m-qwen3 --calls 8 --documents 50 \
  --doc-tokens 200,300 --multiples 0.5 --repeats 3 --seed 7 --json $R/rerank-bench-m-qwen3-half.json
# On a machine with an NVIDIA GPU only: the revisit sequence on the device (the H200's row).
if command -v nvidia-smi >/dev/null; then
  rm -rf /tmp/gc/disk-tier
  $B tiers --model embedded:bench-m --device cuda --dtype bfloat16 --lengths 2048,8192 --repeats 3 \
    --disk /tmp/gc/disk-tier --json $R/tiers-h200-bench-m.json
fi
$B report
