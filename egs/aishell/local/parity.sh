#!/usr/bin/env bash
# Shard-vs-map parity: train the same model on the same corpus twice, once reading a
# map-style pack (large_dataset false) and once streaming tar shards (large_dataset
# true), for the same number of updates, then decode both and print both CERs. Fails
# when the streaming CER is more than --max_relative (default 10%) above or below the
# map-style CER (WeNet reports 4.61 vs 4.67 on AISHELL-1 for the same comparison).
#
# Run after stage 1 of run.sh (the features must exist):
#   bash run.sh --synthetic true --stop_stage 1
#   bash local/parity.sh [--base exp/synth-ctc] [--steps 2000]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=../../../path.sh
. ../../path.sh
# shellcheck source=../../../utils/stage_lib.sh
. ../../utils/stage_lib.sh

base=exp/synth-ctc     # experiment whose config.json and hyper-p.json both runs share
steps=2000             # optimizer updates of each run (instead of a time budget)
max_relative=0.10      # largest allowed |CER_shards - CER_map| / CER_map
nj=2                   # parallel jobs for packing and decoding

# shellcheck source=../../../utils/parse_options.sh
. ../../utils/parse_options.sh

for mode in map shards; do
  exp=$base-parity-$mode
  mkdir -p "$exp"
  cp "$base/config.json" "$exp/config.json"
  python - "$base/hyper-p.json" "$exp" "$mode" "$steps" <<'EOF'
import json
import sys

source, exp, mode, steps = sys.argv[1:]
with open(source, encoding="utf-8") as f:
    hyper = json.load(f)
hyper["tokenizer"]["file"] = f"{exp}/tokenizer.tknz"
option = hyper["train"]["option"]
option.update({"max_steps": int(steps), "time_budget_minutes": 0, "epochs": 1000})
if mode == "shards":
    train_dir = hyper["data"]["train"]
    train_dir = train_dir if isinstance(train_dir, str) else train_dir[0]
    low, high = (hyper["data"].get("filter") or "10:").split(":")
    group = f"{low or 0}:{high}"
    shard_dir = f"data/wds/{train_dir.rstrip('/').split('/')[-1]}"
    hyper["data"]["shards"] = {"dir": shard_dir, "filter_group": [group]}
    option.update({"large_dataset": True,
                   "trset": f"{shard_dir}/{group.replace(':', '_')}/data-*.tar"})
with open(f"{exp}/hyper-p.json", "w", encoding="utf-8") as f:
    json.dump(hyper, f, indent=2, ensure_ascii=False)
    f.write("\n")
EOF
  log "parity ($mode): stages 2-4 of $exp"
  python -m cat.stages.driver prepare "$exp"
  python -m cat.formats.prep_wds pack-exp "$exp" --nj "$nj"
  python -m cat.stages.driver train "$exp"
  python -m cat.stages.driver decode "$exp" --nj "$nj"
done

python - "$base-parity-map/RESULTS.md" "$base-parity-shards/RESULTS.md" "$max_relative" <<'EOF'
import re
import sys

def cers(path):
    """{set: (CER, errors, characters)} from an exp's RESULTS.md table."""
    with open(path, encoding="utf-8") as f:
        rows = re.finditer(r"^\| (\w+) \| ([0-9.]+) \| (\d+) / (\d+) \|", f.read(), re.M)
        return {m[1]: (float(m[2]), int(m[3]), int(m[4])) for m in rows}

map_cer, shard_cer, limit = cers(sys.argv[1]), cers(sys.argv[2]), float(sys.argv[3])
if not map_cer or map_cer.keys() != shard_cer.keys():
    sys.exit(f"parity: the result tables list different sets: {sorted(map_cer)} in "
             f"{sys.argv[1]}, {sorted(shard_cer)} in {sys.argv[2]}")
worst = 0.0
for name, (cer, _, _) in map_cer.items():
    relative = abs(shard_cer[name][0] - cer) / max(cer, 1e-9)
    worst = max(worst, relative)
    print(f"{name}: CER map-style {cer:.2f}  shards {shard_cer[name][0]:.2f}  "
          f"relative difference {100 * relative:.1f}%")
# All sets pooled: twice the characters, so half the noise of a single set's figure.
pooled = [100 * sum(r[1] for r in t.values()) / sum(r[2] for r in t.values())
          for t in (map_cer, shard_cer)]
print(f"all sets pooled: CER map-style {pooled[0]:.2f}  shards {pooled[1]:.2f}  relative "
      f"difference {100 * abs(pooled[1] - pooled[0]) / max(pooled[0], 1e-9):.1f}%")
if worst > limit:
    sys.exit(f"parity failed: relative difference {100 * worst:.1f}% > {100 * limit:.0f}%")
print(f"parity holds: every set within {100 * limit:.0f}% relative")
EOF
