#!/usr/bin/env bash
# One GPU session's measurements, in one call under one deadline: what docs/benchmarks.md's
# "Next on a GPU" asks for. Runs from the repository root of a checkout (oppo_ds importable
# from it, nothing installed); writes everything under OUT.
#
#   bash tools/gpu_session.sh [OUT]        OUT: default $OUT, else gpu-out/
#
# 1. device.txt: nvidia-smi -L and the versions of torch, transformers, deepspeed.
# 2. gpu-test.txt: the CUDA-graph tests (tests/test_static_decode.py -k cuda_graph).
# 3. profile-step4.txt: torch's profile of step 4 of a sequential run decoding with the static
#    cache and a CUDA graph (logging.profile_step=4): where its training phase goes.
# 4. bench.json / bench.md / bench.runs/: one oppo-bench of every entry of MODES (default
#    below) against the same plain sequential run, medians of STEPS - WARMUP steps.
# 5. calibrate.txt: oppo-plan's cost model fitted to that sequential run, the others predicted.
#
# Environment: BUDGET_S (default 570: the whole call's deadline, each part gets what is
# left), STEPS (8), WARMUP (2), MODES, ARCH (qwen2.5-0.5b), SETTINGS (the overrides of every
# run, default the GPU runs' length-oracle workload below), GRAPH, WHEELS (.whl), PYTHON.
#
# A machine without deepspeed (the lent GPU machines' image has torch, transformers, no
# deepspeed, no registry): build the wheels here with `make gpu-wheels` (pure-Python deepspeed
# and its small dependencies, for the GPU machine's Python, PYVER=3.12 by default) and carry
# .whl; this script installs them into a private directory first, nothing else.
set -u
OUT=${1:-${OUT:-gpu-out}}
mkdir -p "$OUT"
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
    $PY -c "import torch, transformers, deepspeed as ds
print('torch', torch.__version__, '| transformers', transformers.__version__,
      '| deepspeed', ds.__version__)"
} > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"

DEFAULT_SETTINGS="workload.kind=length_oracle model.builtin_arch=${ARCH:-qwen2.5-0.5b}
    system.dtype=bf16 generation.max_new_tokens=160 workload.median_len=32 ppo.batch_size=32
    oppo.placement=colocated"
SETTINGS=${SETTINGS:-$DEFAULT_SETTINGS}
GRAPH=${GRAPH:-"generation.static_cache=true,generation.cuda_graph=true"}

echo "== graph tests ($(left) s left)"
timeout "$(left)" $PY -m pytest -q -p no:cacheprovider tests/test_static_decode.py \
    -k cuda_graph > "$OUT/gpu-test.txt" 2>&1
tail -3 "$OUT/gpu-test.txt"

echo "== profile of step 4, sequential with the graph ($(left) s left)"
rm -rf /tmp/oppo-profile-run
# shellcheck disable=SC2086
timeout "$(left)" $PY -m oppo_ds.train steps=4 logging.profile_step=4 $SETTINGS ${GRAPH//,/ } \
    logging.output_dir=/tmp/oppo-profile-run logging.progress=false checkpoint.resume=never \
    checkpoint.final=false checkpoint.export_hf=false eval.prompts=null oppo.streaming=false \
    oppo.overcommit=0 oppo.placement=inline > "$OUT/profile-run.txt" 2>&1
cp /tmp/oppo-profile-run/profile/step_4.txt "$OUT/profile-step4.txt" 2>/dev/null
cp /tmp/oppo-profile-run/metrics.jsonl "$OUT/profile-metrics.jsonl" 2>/dev/null
head -40 "$OUT/profile-step4.txt" 2>/dev/null || tail -20 "$OUT/profile-run.txt"

DEFAULT_MODES="sequential,sequential@graph,oppo@graph,oppo,sequential@blocks,sequential@cudnn"
MODES=${MODES:-$DEFAULT_MODES,sequential@static,inter@graph}
echo "== oppo-bench $MODES ($(left) s left)"
# shellcheck disable=SC2086
timeout "$(left)" $PY -m oppo_ds.cli.bench --modes "$MODES" --steps "${STEPS:-8}" \
    --warmup "${WARMUP:-2}" --json "$OUT/bench.json" --table "$OUT/bench.md" \
    --workdir "$OUT/bench.runs" \
    --variant "graph:$GRAPH" --variant "blocks:$GRAPH,generation.sync_every=16" \
    --variant cudnn:system.cudnn_attention=true --variant static:generation.static_cache=true \
    $SETTINGS > "$OUT/bench.txt" 2>&1
echo "bench exit $?"
cat "$OUT/bench.md" 2>/dev/null || tail -20 "$OUT/bench.txt"

# the planner's costs fitted to this machine's sequential run, its other modes predicted
# (docs/scaling.md, "Checked against reality"); keep bench.json and bench.runs/*/{metrics.jsonl,
# config.yaml} in tests/data/ to repeat it without the machine
echo "== oppo-plan --calibrate ($(left) s left)"
timeout "$(left)" $PY -m oppo_ds.cli.plan --calibrate "$OUT/bench.json" > "$OUT/calibrate.txt" 2>&1
cat "$OUT/calibrate.txt"
