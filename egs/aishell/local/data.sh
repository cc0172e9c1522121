#!/usr/bin/env bash
# Stage 0 of the AISHELL-1 recipe: the release (or its synthetic twin) -> data/{train,dev,test}.
#
# Usage (run.sh calls it from the recipe directory):
#   bash local/data.sh --synthetic true --synthetic_utts 8000   # also data/lm_text/text
#   bash local/data.sh --aishell_root /data/aishell --download true
set -euo pipefail
# shellcheck source=../../../utils/stage_lib.sh
. ../../utils/stage_lib.sh

synthetic=false         # generate and use the synthetic corpus instead of the release
synthetic_utts=8000     # size of the synthetic corpus, in utterances (train+dev+test)
synthetic_seed=0        # seed of the synthetic corpus
lm_sentences=50000      # synthetic LM text (data/lm_text): sentences none of the corpus has
synthetic_dir=corpus/synthetic  # where the synthetic release is written
aishell_root=corpus/aishell     # the real release: the directory holding data_aishell/
download=false          # download the release (OpenSLR 33) into aishell_root first
nj=2                    # parallel jobs of the synthesis

# shellcheck source=../../../utils/parse_options.sh
. ../../utils/parse_options.sh

if $synthetic; then
  python -m cat.data.synth aishell "$synthetic_dir" --num-utts "$synthetic_utts" \
    --seed "$synthetic_seed" --nj "$nj"
  root=$synthetic_dir
  signature="$(cd "$root" && pwd) $synthetic_utts $synthetic_seed $lm_sentences"
  if is_done data/lm_text/.done "$signature"; then
    log "data/lm_text/text already generated"
  else
    python -m cat.data.synth lm-text "$synthetic_dir" data/lm_text/text \
      --num-sentences "$lm_sentences"
    mark_done data/lm_text/.done "$signature"
  fi
else
  if $download; then
    python -m cat.data.aishell download "$aishell_root"
  fi
  root=$aishell_root
fi
root=$(cd "$root" && pwd)
if is_done data/.prepare.done "$root"; then
  log "data/{train,dev,test} already prepared from $root"
else
  python -m cat.data.aishell prepare "$root" data
  mark_done data/.prepare.done "$root"
fi
# The release's pronunciation lexicon (phone units of CTC-CRF: exp/*crf*).
if [ -f "$root/resource_aishell/lexicon.txt" ]; then
  mkdir -p data/local
  cp "$root/resource_aishell/lexicon.txt" data/local/.lexicon.txt.tmp
  mv data/local/.lexicon.txt.tmp data/local/lexicon.txt
fi
