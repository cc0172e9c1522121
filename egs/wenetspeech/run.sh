#!/usr/bin/env bash
# WenetSpeech recipe: Conformer CTC / RNN-T on the S, M or L subset, streaming the
# training set from webdataset tar shards (large_dataset), to a CER table on
# DEV, TEST_NET and TEST_MEETING.
#
# Stages:
#   0  data preparation: WenetSpeech.json (parsed as a stream) -> data/{train_<subset>,dev,
#      test_net,test_meeting} with segments
#   1  features: 80-dim fbank cut from the long Opus recordings -> data/fbank/<set>
#   2  tokenizer, tar shards of the training set in length groups, map-style dev/test packs
#   3  training (exp/<name>/hyper-p.json + config.json)
#   4  decoding and CER scoring
#   5  language models (hyper-p.json: inference.lm, e.g. exp/lm-trans-5gram), decoding with
#      them -> exp/<name>/RESULTS-lm.md (nothing to do without inference.lm)
#
# Usage:
#   bash run.sh --synthetic true                                  # synthetic twin, every stage
#   bash run.sh --wenetspeech_root /data/WenetSpeech --train_subset L --exp exp/train_l/ctc-v1
#   bash run.sh --train_subset L --stage 5 --exp exp/train_l/rnnt-v1  # LMs, decoding with them
# Every stage skips work that is already done; a failed stage stops the script.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
. ../../path.sh
. ../../utils/stage_lib.sh

stage=0                 # first stage to run
stop_stage=5            # last stage to run
synthetic=false         # generate and use the synthetic corpus instead of the release
synthetic_hours=3.0     # size of the synthetic corpus, in hours of speech (all sets)
synthetic_seed=0        # seed of the synthetic corpus
synthetic_dir=corpus/synthetic  # where the synthetic release is written
wenetspeech_root=corpus/wenetspeech  # the real release: holds WenetSpeech.json and audio/
train_subset=            # S, M or L; default L for the synthetic corpus, M for the release
nj=2                    # parallel jobs for feature extraction and packing
speed_perturb=          # speed factors added to the training set (e.g. 0.9,1.1)
exp=                    # experiment dir; default exp/synth-ctc or exp/train_m/ctc-v1
nproc=1                 # training processes (GPUs, or CPU processes with gloo)

. ../../utils/parse_options.sh

if [ -z "$train_subset" ]; then
  if $synthetic; then train_subset=L; else train_subset=M; fi
fi
if [ -z "$exp" ]; then
  if $synthetic; then exp=exp/synth-ctc; else exp=exp/train_m/ctc-v1; fi
fi
train_set=train_$(echo "$train_subset" | tr '[:upper:]' '[:lower:]')

if [ "$stage" -le 0 ] && [ "$stop_stage" -ge 0 ]; then
  log "Stage 0: data preparation ($train_set, dev, test_net, test_meeting)"
  root=$wenetspeech_root
  if $synthetic; then
    python -m cat.data.synth wenetspeech "$synthetic_dir" --hours "$synthetic_hours" \
      --seed "$synthetic_seed" --nj "$nj"
    root=$synthetic_dir
  fi
  root=$(cd "$root" && pwd)
  if is_done data/.prepare.done "$root $train_subset"; then
    log "  data/ already prepared from $root"
  else
    python -m cat.data.wenetspeech prepare "$root" data --train-subset "$train_subset"
    mark_done data/.prepare.done "$root $train_subset"
  fi
fi

if [ "$stage" -le 1 ] && [ "$stop_stage" -ge 1 ]; then
  log "Stage 1: fbank features"
  for part in "$train_set" dev test_net test_meeting; do
    opts=()
    if [ "$part" = "$train_set" ] && [ -n "$speed_perturb" ]; then
      opts=(--speed-perturb "$speed_perturb")
    fi
    signature="$(cat data/.prepare.done) ${opts[*]}"
    if is_done "data/fbank/$part/.done" "$signature"; then
      log "  data/fbank/$part already extracted"
      continue
    fi
    python -m cat.data.features --nj "$nj" "${opts[@]}" "data/$part" "data/fbank/$part"
    mark_done "data/fbank/$part/.done" "$signature"
  done
fi

if [ "$stage" -le 2 ] && [ "$stop_stage" -ge 2 ]; then
  log "Stage 2: tokenizer, shards and packs for $exp"
  python -m cat.utils.pipeline prepare "$exp" --nj "$nj"
fi

if [ "$stage" -le 3 ] && [ "$stop_stage" -ge 3 ]; then
  log "Stage 3: training $exp"
  python -m cat.utils.pipeline train "$exp" --nproc "$nproc"
fi

if [ "$stage" -le 4 ] && [ "$stop_stage" -ge 4 ]; then
  log "Stage 4: decoding and scoring $exp"
  python -m cat.utils.pipeline decode "$exp" --nj "$nj"
  cat "$exp/RESULTS.md"
fi

if [ "$stage" -le 5 ] && [ "$stop_stage" -ge 5 ]; then
  log "Stage 5: language models and decoding $exp with them"
  python -m cat.utils.pipeline lm "$exp" --nj "$nj"
fi
log "Done: stages $stage-$stop_stage"
