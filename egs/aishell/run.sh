#!/usr/bin/env bash
# AISHELL-1 recipe: Conformer CTC / RNN-T from the release layout to a CER table.
#
# Stages:
#   0  data preparation: the release (or a synthetic twin) -> data/{train,dev,test}
#   1  features: 80-dim fbank -> data/fbank/{train_sp,dev,test} (train speed-perturbed)
#   2  tokenizer and packs for the experiment (map-style packs, or tar shards when
#      hyper-p.json sets train.option.large_dataset)
#   3  training (exp/<name>/hyper-p.json + config.json)
#   4  decoding and CER scoring
#   5  language models (hyper-p.json: inference.lm names them, e.g. exp/lm-char-5gram):
#      n-gram training, weights tuned on dev, decoding with shallow fusion / LODR /
#      N-best rescoring -> exp/<name>/RESULTS-lm.md (nothing to do without inference.lm)
#
# Usage:
#   bash run.sh --synthetic true                       # synthetic corpus, every stage
#   bash run.sh --aishell_root /data/aishell --download true --exp exp/ctc-v1
#   bash run.sh --stage 2 --stop_stage 2 --exp exp/ctc-v1
#   bash run.sh --stage 5 --exp exp/ctc-v1             # LMs and decoding with them
#   bash run.sh --synthetic true --stage 2 --exp exp/synth-ctc-short   # short model + LMs
# Every stage skips work that is already done; a failed stage stops the script.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
. ../../path.sh
. ../../utils/stage_lib.sh

stage=0                 # first stage to run
stop_stage=5            # last stage to run
synthetic=false         # generate and use the synthetic corpus instead of the release
synthetic_utts=8000     # size of the synthetic corpus, in utterances (train+dev+test)
synthetic_seed=0        # seed of the synthetic corpus
synthetic_dir=corpus/synthetic  # where the synthetic release is written
lm_sentences=50000      # synthetic LM text (data/lm_text): sentences none of the corpus has
aishell_root=corpus/aishell     # the real release: the directory holding data_aishell/
download=false          # download the release (OpenSLR 33) into aishell_root first
nj=2                    # parallel jobs for feature extraction and packing
speed_perturb=0.9,1.1   # speed factors added to train ("" for none)
exp=                    # experiment dir; default exp/synth-ctc (synthetic) or exp/ctc-v1
nproc=1                 # training processes (GPUs, or CPU processes with gloo)

. ../../utils/parse_options.sh

if [ -z "$exp" ]; then
  if $synthetic; then exp=exp/synth-ctc; else exp=exp/ctc-v1; fi
fi
train_dir=data/fbank/train
[ -n "$speed_perturb" ] && train_dir=data/fbank/train_sp

if [ "$stage" -le 0 ] && [ "$stop_stage" -ge 0 ]; then
  log "Stage 0: data preparation"
  if $synthetic; then
    python -m cat.data.synth aishell "$synthetic_dir" --num-utts "$synthetic_utts" \
      --seed "$synthetic_seed" --nj "$nj"
    root=$synthetic_dir
    signature="$(cd "$root" && pwd) $synthetic_utts $synthetic_seed $lm_sentences"
    if is_done data/lm_text/.done "$signature"; then
      log "  data/lm_text/text already generated"
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
    log "  data/{train,dev,test} already prepared from $root"
  else
    python -m cat.data.aishell prepare "$root" data
    mark_done data/.prepare.done "$root"
  fi
fi

if [ "$stage" -le 1 ] && [ "$stop_stage" -ge 1 ]; then
  log "Stage 1: fbank features"
  for part in train dev test; do
    out=data/fbank/$part
    opts=()
    if [ "$part" = train ] && [ -n "$speed_perturb" ]; then
      out=$train_dir
      opts=(--speed-perturb "$speed_perturb")
    fi
    signature="$(cat data/.prepare.done) ${opts[*]}"
    if is_done "$out/.done" "$signature"; then
      log "  $out already extracted"
      continue
    fi
    python -m cat.data.features --nj "$nj" "${opts[@]}" "data/$part" "$out"
    mark_done "$out/.done" "$signature"
  done
fi

if [ "$stage" -le 2 ] && [ "$stop_stage" -ge 2 ]; then
  log "Stage 2: tokenizer and packs for $exp"
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
