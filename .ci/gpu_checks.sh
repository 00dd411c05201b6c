#!/bin/bash
# The GPU checks in one call (a 16-core GPU machine with torch, no package registry), each under a timeout, logs
# under $OUT (default /tmp/gpu_checks): the cuda group, bench.py adapt / e2e, the quickstart timed, and the
# rest of the suite on CPUs of its own (taskset) beside the cuda group and the step benchmarks. Wheels the machine
# lacks go in .gpu/ first (ftfy, wcwidth, nltk, defusedxml, pytest-xdist and execnet for pytest -n, openai-clip;
# meteor-1.5.jar for METEOR's synonyms; without transformers and its own wheels the Hugging Face tests skip):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .gpu \
#       ftfy wcwidth nltk defusedxml pytest-xdist execnet
#   pip wheel --no-deps openai-clip==1.0.1 -w .gpu; cp <pycocoevalcap>/meteor/meteor-1.5.jar .gpu/
# then: BUDGET=420 bash .ci/gpu_checks.sh    (BUDGET: seconds for the whole list; a step gets what is left). On a
# CPU the same script is its own dry run: the CUDA tests skip, each GPU step runs on the CPU until its limit.
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_checks}; mkdir -p $OUT
T0=$SECONDS; END=${BUDGET:-420}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 METEOR_DATA=$PWD/.gpu
S=$OUT/summary.txt
A=""; B=""; (( $(nproc) >= 16 )) && command -v taskset >/dev/null && { A="taskset -c 0-7"; B="taskset -c 8-15"; }
{ date -u; git log -1 --format='%h %s' 2>/dev/null | cut -c1-80; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  python3 -c "import torch as t; print('torch', t.__version__, 'cuda', t.version.cuda, t.cuda.is_available() and t.cuda.get_device_name())"
  nproc; } 2>&1 | tee $S
step() {  # step NAME LIMIT LOG cmd...: the limit shrinks to what is left of the budget
  local name=$1 lim=$2 log=$3; shift 3
  local left=$(( END - (SECONDS - T0) - 5 )); (( lim > left )) && lim=$left
  (( lim < 10 )) && { echo "== $name skipped: no time left" | tee -a $S; return; }
  echo "== $name (limit $lim s) at $((SECONDS - T0)) s" | tee -a $log
  local s=$SECONDS; timeout -k 5 $lim "$@" >> $log 2>&1; local rc=$?
  echo "== $name: rc $rc in $((SECONDS - s)) s" | tee -a $S $log
}
# the CPU suite on CPUs 8-15, in the background
( s=$SECONDS; timeout -k 5 420 $B python3 -m pytest test_all.py -rs -m "not cuda" -n 8 -q > $OUT/suite.log 2>&1
  echo "== suite (not cuda, -n 8 on CPUs 8-15): rc $? in $((SECONDS - s)) s" | tee -a $S $OUT/suite.log ) &
SUITE=$!
step "cuda group" 150 $OUT/cuda.log $A python3 -m pytest test_all.py -rs -m cuda -n 6 --durations=0
step "bench adapt" 140 $OUT/adapt.log $A python3 bench.py adapt --profile ours+compile+graphs
wait $SUITE
step "bench e2e" 50 $OUT/e2e.log python3 bench.py e2e
step "quickstart" 75 $OUT/quick.log bash -c 'time python3 adapt.py --data clevr && time python3 caption.py --ckpt adapted.pt'
echo "== total $((SECONDS - T0)) s" | tee -a $S
for f in cuda adapt e2e quick; do echo "---- $f"; grep -E "passed|failed|error|ms/step|pairs/s|MFU|steps in|vs eager|real|CIDEr|done in|Error|==" $OUT/$f.log | tail -40; done
echo "---- suite"; tail -25 $OUT/suite.log
