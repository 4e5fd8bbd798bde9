#!/usr/bin/env bash
# One GPU session's measurements, in one call under one deadline: what docs/benchmarks.md's
# "Next on a GPU" asks for. Runs from the repository root of a checkout (oppo_ds importable
# from it, nothing installed); writes everything under OUT.
#
#   bash tools/gpu_session.sh [OUT]        OUT: default $OUT, else gpu-out/
#
# 1. device.txt: nvidia-smi -L, the processor, the versions of torch, transformers, deepspeed.
# 2. gpu-test.txt: the tests that need a GPU (the CUDA graph's, the colocated side stream's).
# 3. bench.json / bench.md / bench.runs/: one oppo-bench of every entry of MODES (default
#    below) against the same plain sequential run, medians of STEPS - WARMUP steps.
# 4. peer-trl-graph/ and peer-trl-graph.json, then peer-trl/ and peer-trl.json: TRL 1.12's PPO
#    on the same settings and steps, when trl imports (PEER=0 skips both), and oppo-bench's
#    summary of its steps (samples_per_s, tokens_per_s, ...): first with GRAPH's overrides
#    (HF's static cache, its forward compiled by transformers: mode reduce-overhead, CUDA
#    graphs; the decode our @graph runs get; PEER_GRAPH=0 skips it), then decoding by default.
# 5. profile-run/profile/step_4.txt, when PROFILE=1 and time is left: torch's profile of step
#    4 of a sequential run decoding with the static cache and a CUDA graph.
# 6. calibrate.txt: oppo-plan's cost model fitted to that sequential run, the others predicted.
#
# Everything is written under a work folder (/tmp/gpu-work) and, on exit, packed into
# OUT/session.tgz (model weights and checkpoints left out) with the few summaries beside it:
# the device tool brings back at most 8 files from OUT.
#
# Environment: BUDGET_S (default 570: the whole call's deadline, each part gets what is
# left), TESTS_S (150: the tests' own limit), STEPS (8), WARMUP (2), MODES (variants beside
# graph: blocks, cudnn, static; sw and swfast = graph with Python's thread switch interval
# at SWITCH_MS, 0.5, and SWITCH_FAST_MS, 0.1 milliseconds; noclip = graph without gradient
# clipping; z1 = graph under ZeRO-1, with bf16 DeepSpeed's flat BF16 optimizer (gradients in
# fp32, system.grad_accum_dtype auto, since the 34th session; run7's z1 was before it); z1bf16
# = the same with bf16 gradients, its ZeRO optimizer; z2 = graph under ZeRO-2), ARCH
# (qwen2.5-0.5b), SETTINGS (the overrides of every run, default the GPU runs' length-oracle
# workload below), GRAPH, PEER (1), PEER_GRAPH (1), PROFILE (0), WORK (/tmp/gpu-work),
# WHEELS (.whl), PYTHON.
#
# A machine without deepspeed (the lent GPU machines' image has torch, transformers, no
# deepspeed, no registry): build the wheels here with `make gpu-wheels` (pure-Python deepspeed
# and its small dependencies, for the GPU machine's Python, PYVER=3.12 by default) and carry
# .whl; this script installs them into a private directory first, nothing else.
set -u
OUT=$(realpath -m "${1:-${OUT:-gpu-out}}")
mkdir -p "$OUT"
W=${WORK:-/tmp/gpu-work}
rm -rf "$W" && mkdir -p "$W"
pack() {
    tar czf "$OUT/session.tgz" -C "$W" --exclude='*.safetensors' --exclude='*.pt' \
        --exclude='*.bin' --exclude='checkpoints' --exclude='profile/*.json' . 2>/dev/null
    for f in device.txt gpu-test.txt bench.md calibrate.txt peer-trl-graph.json peer-trl.json; do
        if [ -f "$W/$f" ]; then cp "$W/$f" "$OUT/"; fi
    done
}
trap pack EXIT
DEADLINE=$((SECONDS + ${BUDGET_S:-570}))
left() { echo $((DEADLINE - SECONDS > 1 ? DEADLINE - SECONDS : 1)); }
PY=${PYTHON:-python}

if ! $PY -c "import deepspeed" 2>/dev/null; then
    WHEELS=${WHEELS:-.whl}
    if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        echo "no deepspeed and no wheels in $WHEELS: run 'make gpu-wheels' where a registry" \
             "is reachable, and carry $WHEELS" >&2
        exit 2
    fi
    $PY -m pip install -q --no-deps --no-index --target /tmp/oppo-site "$WHEELS"/*.whl || exit 2
    export PYTHONPATH=/tmp/oppo-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export DS_BUILD_OPS=0 HF_HUB_OFFLINE=1

{
    nvidia-smi -L
    grep -m1 "model name" /proc/cpuinfo
    $PY -c "import torch, transformers, deepspeed as ds
print('torch', torch.__version__, '| transformers', transformers.__version__,
      '| deepspeed', ds.__version__)"
} > "$W/device.txt" 2>&1
cat "$W/device.txt"

DEFAULT_SETTINGS="workload.kind=length_oracle model.builtin_arch=${ARCH:-qwen2.5-0.5b}
    system.dtype=bf16 generation.max_new_tokens=160 workload.median_len=32 ppo.batch_size=32
    oppo.placement=colocated"
SETTINGS=${SETTINGS:-$DEFAULT_SETTINGS}
GRAPH=${GRAPH:-"generation.static_cache=true,generation.cuda_graph=true"}

echo "== GPU tests ($(left) s left)"
timeout "$(( $(left) < ${TESTS_S:-150} ? $(left) : ${TESTS_S:-150} ))" \
    $PY -m pytest -q -p no:cacheprovider -rs tests/test_static_decode.py \
    tests/test_streaming.py -k "cuda_graph or on_cuda" > "$W/gpu-test.txt" 2>&1
tail -3 "$W/gpu-test.txt"

DEFAULT_MODES="sequential,sequential@graph,intra@graph,inter@graph,oppo@graph,oppo"
MODES=${MODES:-$DEFAULT_MODES}
echo "== oppo-bench $MODES ($(left) s left)"
# shellcheck disable=SC2086
timeout "$(left)" $PY -m oppo_ds.cli.bench --modes "$MODES" --steps "${STEPS:-8}" \
    --warmup "${WARMUP:-2}" --json "$W/bench.json" --table "$W/bench.md" \
    --workdir "$W/bench.runs" \
    --variant "graph:$GRAPH" --variant "blocks:$GRAPH,generation.sync_every=16" \
    --variant cudnn:system.cudnn_attention=true --variant static:generation.static_cache=true \
    --variant "sw:$GRAPH,system.switch_interval_ms=${SWITCH_MS:-0.5}" \
    --variant "swfast:$GRAPH,system.switch_interval_ms=${SWITCH_FAST_MS:-0.1}" \
    --variant "noclip:$GRAPH,ppo.grad_clip=0" \
    --variant "z1:$GRAPH,system.zero_stage=1" --variant "z2:$GRAPH,system.zero_stage=2" \
    --variant "z1bf16:$GRAPH,system.zero_stage=1,system.grad_accum_dtype=bf16" \
    $SETTINGS > "$W/bench.txt" 2>&1
echo "bench exit $?"
cat "$W/bench.md" 2>/dev/null || tail -20 "$W/bench.txt"

# TRL's PPO on the same settings, prompts and steps, its own process after the bench (whose
# JSON is then written whatever TRL does); its summary is oppo-bench's for a peer. Both ways:
# with the graph variant's decode (HF's static cache, compiled by transformers: what
# oppo@graph's ratio to TRL should be taken against) first, then TRL's default decode.
peer() {  # NAME OVERRIDES...: one TRL run in $W/NAME, its summary in $W/NAME.json
    local name=$1
    shift
    echo "== TRL peer $name ($(left) s left)"
    # shellcheck disable=SC2086
    timeout "$(left)" $PY -m oppo_ds.peers.trl_peer --steps "${STEPS:-8}" --seed 0 \
        --out "$W/$name" $SETTINGS "$@" > "$W/$name.txt" 2>&1
    echo "peer $name exit $?"
    $PY -c "import json, sys; from oppo_ds import bench
rows = [json.loads(line) for line in open(sys.argv[1])]
print(json.dumps(bench.summarize_mode(rows, ${WARMUP:-2}, hidden_default=0.0), indent=1))" \
        "$W/$name/metrics.jsonl" > "$W/$name.json" 2>&1
    cat "$W/$name.json"
}
if [ "${PEER:-1}" = 1 ] && $PY -c "import trl, datasets" 2>/dev/null; then
    if [ "${PEER_GRAPH:-1}" = 1 ]; then
        # shellcheck disable=SC2086
        peer peer-trl-graph ${GRAPH//,/ }
    fi
    peer peer-trl
fi

# where a sequential step with the graph goes, if time is left (about 60 s)
if [ "${PROFILE:-0}" = 1 ] && [ "$(left)" -gt 90 ]; then
    echo "== profile of step 4, sequential with the graph ($(left) s left)"
    # shellcheck disable=SC2086
    timeout "$(left)" $PY -m oppo_ds.train steps=4 logging.profile_step=4 $SETTINGS \
        ${GRAPH//,/ } logging.output_dir="$W/profile-run" logging.progress=false \
        checkpoint.resume=never checkpoint.final=false checkpoint.export_hf=false \
        eval.prompts=null oppo.streaming=false oppo.overcommit=0 oppo.placement=inline \
        > "$W/profile-run.txt" 2>&1
    head -40 "$W/profile-run/profile/step_4.txt" 2>/dev/null || tail -20 "$W/profile-run.txt"
fi

# the planner's costs fitted to this machine's sequential run, its other modes predicted
# (docs/scaling.md, "Checked against reality"); keep bench.json and bench.runs/*/{metrics.jsonl,
# config.yaml} in tests/data/ to repeat it without the machine
echo "== oppo-plan --calibrate ($(left) s left)"
timeout "$(left)" $PY -m oppo_ds.cli.plan --calibrate "$W/bench.json" > "$W/calibrate.txt" 2>&1
cat "$W/calibrate.txt"
