#!/usr/bin/env bash
# AISHELL-1 recipe: Conformer CTC / RNN-T from the release layout to a CER table.
#
# Stages (../../utils/asr.sh; stage 0 is local/data.sh):
#   0  data preparation: the release (or a synthetic twin) -> data/{train,dev,test}
#   1  features: 80-dim fbank -> data/fbank/{train_sp,dev,test} (train speed-perturbed)
#   2  tokenizer and map-style packs, or tar shards when hyper-p.json sets
#      train.option.large_dataset (cat.formats.prep_wds, groups from data.shards)
#   3  training (exp/<name>/hyper-p.json + config.json)
#   4  decoding and CER scoring
#   5  language models (hyper-p.json: inference.lm names them), decoding with them
#      -> exp/<name>/RESULTS-lm.md (nothing to do without inference.lm)
#
# Usage:
#   bash run.sh --synthetic true                       # synthetic corpus, every stage
#   bash run.sh --aishell_root /data/aishell --download true --exp exp/ctc-v1
#   bash run.sh --stage 2 --stop_stage 2 --exp exp/ctc-v1
#   bash run.sh --synthetic true --stage 5 --exp exp/synth-ctc-short  # LMs, decoding with them
# Every stage skips work that is already done; a failed stage stops the script.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
. ../../path.sh

stage=0                 # first stage to run
stop_stage=5            # last stage to run
synthetic=false         # generate and use the synthetic corpus instead of the release
synthetic_utts=8000     # size of the synthetic corpus, in utterances (train+dev+test)
synthetic_seed=0        # seed of the synthetic corpus
lm_sentences=50000      # synthetic LM text (data/lm_text): sentences none of the corpus has
aishell_root=corpus/aishell  # the real release: the directory holding data_aishell/
download=false          # download the release (OpenSLR 33) into aishell_root first
nj=2                    # parallel jobs for synthesis, features, packing and decoding
speed_perturb=0.9,1.1   # speed factors added to train ("" for none)
exp=                    # experiment dir; default exp/synth-ctc (synthetic) or exp/ctc-v1
nproc=1                 # training processes (GPUs, or CPU processes with gloo)

# Further options of ../../utils/asr.sh (e.g. --test_sets) are passed on to it; --help lists them.
po_forward_to=../../utils/asr.sh
. ../../utils/parse_options.sh

if [ -z "$exp" ]; then
  if $synthetic; then exp=exp/synth-ctc; else exp=exp/ctc-v1; fi
fi

# exec: a signal to this script (Ctrl-C, kill, a scheduler) reaches asr.sh, which stops the
# running stage (training saves first) and ends; nothing is left running.
exec ../../utils/asr.sh --stage "$stage" --stop_stage "$stop_stage" --nj "$nj" --nproc "$nproc" \
  --exp "$exp" --train_set train --test_sets "dev test" --speed_perturb "$speed_perturb" \
  --local_data_opts "--synthetic $synthetic --synthetic_utts $synthetic_utts \
--synthetic_seed $synthetic_seed --lm_sentences $lm_sentences --aishell_root $aishell_root \
--download $download --nj $nj" \
  "${po_forwarded[@]}"
