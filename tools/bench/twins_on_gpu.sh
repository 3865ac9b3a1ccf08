#!/usr/bin/env bash
# Every installed family's tiny twin through a 2-step RL run on one GPU (engine and trainer
# colocated), the way `tests/test_family_twins.py` runs them on CPU. Prints one line per family:
#   FAMILY rc=0 rollout_logprob_abs_diff=... replayed_match=... seconds=...
# Usage: bash tools/bench/twins_on_gpu.sh [OUT_DIR] [FAMILY...]
set -u
out=${1:-/tmp/twins}; shift || true
mkdir -p "$out"
cli="python3 -m miles.core.cli"
families=("$@")
if [ ${#families[@]} -eq 0 ]; then
  mapfile -t families < <($cli components list --kind family --json |
    python3 -c 'import json,sys; print("\n".join(c["name"] for c in json.load(sys.stdin)))')
fi
for f in "${families[@]}"; do
  replay=$(python3 -c "
from miles.core.registry.plugins import get_plugin_manager
print('ids' if get_plugin_manager().get('family', '$f').spec.factory().router else 'off')")
  start=$(date +%s)
  $cli run quickstart --run-dir "$out/$f" --set model.family="$f" --set moe.routing_replay=$replay \
    --set placement=colocated --set steps=2 --set warmstart.steps=0 --set eval.data=null \
    --set rollout.prompts_per_step=4 --set rollout.samples_per_prompt=4 \
    --set telemetry.progress=false --set checkpoint.at_end=false > "$out/$f.log" 2>&1
  rc=$?
  python3 - "$f" "$rc" "$(( $(date +%s) - start ))" "$out/$f/metrics.jsonl" <<'PY'
import json, sys
family, rc, seconds, path = sys.argv[1:]
try:
    rows = [json.loads(l) for l in open(path)]
except OSError:
    rows = []
last = rows[-1] if rows else {}
print(family, f"rc={rc}", f"steps={len(rows)}",
      f"rollout_logprob_abs_diff={last.get('train/rollout_logprob_abs_diff')}",
      f"replayed_match={last.get('moe/replayed_match')}", f"seconds={seconds}")
PY
done
