#!/usr/bin/env bash
# Stage 0 of the WenetSpeech recipe: WenetSpeech.json (parsed as a stream) or its synthetic
# twin -> data/{train_<subset>,dev,test_net,test_meeting} with segments.
#
# Usage (run.sh calls it from the recipe directory):
#   bash local/data.sh --synthetic true --synthetic_hours 3 --train_subset L
#   bash local/data.sh --wenetspeech_root /data/WenetSpeech --train_subset M
set -euo pipefail
# shellcheck source=../../../utils/stage_lib.sh
. ../../utils/stage_lib.sh

synthetic=false         # generate and use the synthetic corpus instead of the release
synthetic_hours=3.0     # size of the synthetic corpus, in hours of speech (all sets)
synthetic_seed=0        # seed of the synthetic corpus
synthetic_dir=corpus/synthetic  # where the synthetic release is written
wenetspeech_root=corpus/wenetspeech  # the real release: holds WenetSpeech.json and audio/
train_subset=L          # S, M or L
nj=2                    # parallel jobs of the synthesis

# shellcheck source=../../../utils/parse_options.sh
. ../../utils/parse_options.sh

root=$wenetspeech_root
if $synthetic; then
  python -m cat.data.synth wenetspeech "$synthetic_dir" --hours "$synthetic_hours" \
    --seed "$synthetic_seed" --nj "$nj"
  root=$synthetic_dir
fi
root=$(cd "$root" && pwd)
if is_done data/.prepare.done "$root $train_subset"; then
  log "data/ already prepared from $root"
else
  python -m cat.data.wenetspeech prepare "$root" data --train-subset "$train_subset"
  mark_done data/.prepare.done "$root $train_subset"
fi
# The release has no lexicon: one of the training transcripts' words, from pypinyin
# (phone units of CTC-CRF: exp/train_*/crf-v1).
train_dir=data/train_$(echo "$train_subset" | tr '[:upper:]' '[:lower:]')
if [ -f "$train_dir/text" ] && ! is_done data/local/lexicon.txt.done "$root $train_subset"; then
  python -m cat.text.lexicon pinyin --text "$train_dir/text" --out data/local/lexicon.txt
  mark_done data/local/lexicon.txt.done "$root $train_subset"
fi
