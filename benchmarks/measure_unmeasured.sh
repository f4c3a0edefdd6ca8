#!/usr/bin/env bash
# Fill every table `python -m benchmarks.report` marks "unmeasured" on THIS machine, then
# regenerate the tables. Run from the repository root with the main environment active and the
# models prepared (`tandem models prepare`), on a quiet machine: one benchmark at a time,
# pinned as the other benchmarks are (device work on cores 0,1 with 2 threads, single-thread
# work on core 0, the cloud model on core 1). Each writes benchmarks/results/<family>/<name>.json
# with its provenance (commit, date, command, CPU and flags, affinity, versions).
#
# Wall-time estimates are for a 2-core AMD EPYC without avx512_bf16, scaled from --quick runs on
# a busy machine (see each line); about 20-30 minutes in all.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}

step() { echo; echo "== $*"; local t=$SECONDS; "$@"; echo "== $((SECONDS - t)) s"; }

# collab-math: µs per position of every decoding rule, bytes per round (no model). ~5 s
# (--quick, 3 calls per rule: 1.8 s wall; 30 calls add ~25 ms per call round).
step taskset -c 0 "$PY" -m benchmarks.collab_math

# tui-render: the TUI's cost per streamed token, headless (no model). ~20-30 s
# (--quick, 300 tokens + 20 paced: 3.5 s; the full run streams 3,350 tokens at ~2.5 ms plus
# 300 paced at 50 tokens/s = 6 s of pacing).
step taskset -c 0 "$PY" -m benchmarks.tui_render

# batched-decode: one decode pass of B = 1..16 sequences, the cloud model (ONNX int4), one
# thread. ~4-6 min (--quick on the real 1.5B model, B = 1, 2, 4: 90 s on the busy machine,
# prefill-bound; the full run prefills 4.4× the tokens and times 9 passes per B).
step taskset -c 1 "$PY" -m benchmarks.batched_decode

# index: embedder torch vs ONNX, ingest pipeline, search at 10k and 100k chunks, 2 threads.
# ~8-12 min (--quick, 16 chunks: 158 s on the busy machine, most of it the MiniLM export and
# model loads; the full run embeds 256 chunks 7 times and fills a 100,000-chunk store).
step taskset -c 0,1 "$PY" -m benchmarks.index --threads 2

# device-runtime and device-quantisation (and the README's device-decode row): every backend of
# the 0.5B device model, 2 threads. ~6-10 min (--quick on the tiny model: 50 s; the real model
# adds an int4 quantisation of the fp32 ONNX and 5 model loads, torch bf16 without avx512_bf16
# is the slowest backend).
step taskset -c 0,1 "$PY" -m benchmarks.device_runtime

step "$PY" -m benchmarks.report
