#!/usr/bin/env bash
# WenetSpeech recipe: Conformer CTC / RNN-T on the S, M or L subset, streaming the
# training set from webdataset tar shards (large_dataset), to a CER table on
# DEV, TEST_NET and TEST_MEETING.
#
# Stages (../../utils/asr.sh; stage 0 is local/data.sh):
#   0  data preparation: WenetSpeech.json (parsed as a stream) -> data/{train_<subset>,dev,
#      test_net,test_meeting} with segments
#   1  features: 80-dim fbank cut from the long Opus recordings -> data/fbank/<set>
#   2  tokenizer, map-style dev pack, tar shards of the training set in the length groups
#      of hyper-p.json data.shards (cat.formats.prep_wds)
#   3  training (exp/<name>/hyper-p.json + config.json)
#   4  decoding and CER scoring
#   5  language models (hyper-p.json: inference.lm names them), decoding with them
#      -> exp/<name>/RESULTS-lm.md (nothing to do without inference.lm)
#
# Usage:
#   bash run.sh --synthetic true                                  # synthetic twin, every stage
#   bash run.sh --wenetspeech_root /data/WenetSpeech --train_subset L --exp exp/train_l/ctc-v1
#   bash run.sh --train_subset L --stage 5 --exp exp/train_l/rnnt-v1  # LMs, decoding with them
# Every stage skips work that is already done; a failed stage stops the script.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
. ../../path.sh

stage=0                 # first stage to run
stop_stage=5            # last stage to run
synthetic=false         # generate and use the synthetic corpus instead of the release
synthetic_hours=3.0     # size of the synthetic corpus, in hours of speech (all sets)
synthetic_seed=0        # seed of the synthetic corpus
wenetspeech_root=corpus/wenetspeech  # the real release: holds WenetSpeech.json and audio/
train_subset=            # S, M or L; default L for the synthetic corpus, M for the release
nj=2                    # parallel jobs for synthesis, features, packing and decoding
speed_perturb=          # speed factors added to the training set (e.g. 0.9,1.1)
exp=                    # experiment dir; default exp/synth-ctc or exp/train_m/ctc-v1
nproc=1                 # training processes (GPUs, or CPU processes with gloo)

# Further options of ../../utils/asr.sh (e.g. --test_sets) are passed on to it; --help lists them.
po_forward_to=../../utils/asr.sh
. ../../utils/parse_options.sh

if [ -z "$train_subset" ]; then
  if $synthetic; then train_subset=L; else train_subset=M; fi
fi
if [ -z "$exp" ]; then
  if $synthetic; then exp=exp/synth-ctc; else exp=exp/train_m/ctc-v1; fi
fi
train_set=train_$(echo "$train_subset" | tr '[:upper:]' '[:lower:]')

# exec: a signal to this script (Ctrl-C, kill, a scheduler) reaches asr.sh, which stops the
# running stage (training saves first) and ends; nothing is left running.
exec ../../utils/asr.sh --stage "$stage" --stop_stage "$stop_stage" --nj "$nj" --nproc "$nproc" \
  --exp "$exp" --train_set "$train_set" --test_sets "dev test_net test_meeting" \
  --speed_perturb "$speed_perturb" \
  --local_data_opts "--synthetic $synthetic --synthetic_hours $synthetic_hours \
--synthetic_seed $synthetic_seed --wenetspeech_root $wenetspeech_root \
--train_subset $train_subset --nj $nj" \
  "${po_forwarded[@]}"
