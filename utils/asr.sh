#!/usr/bin/env bash
# The stages every ASR recipe shares, run from a recipe directory (egs/<corpus>/) by its
# run.sh, which holds the corpus's settings and its own data preparation, local/data.sh.
#
# Stages:
#   0  data preparation: local/data.sh $local_data_opts -> data/<set>/
#   1  features: 80-dim fbank -> data/fbank/<set> (the training set speed-perturbed into
#      data/fbank/<train_set>_sp when --speed_perturb is given), for the feature dirs the
#      experiment's hyper-p.json data names (none for a training set packed as audio
#      shards, data.shards.audio, which the loader turns into features); with another
#      front end than Kaldi's (data.front_end: sherpa-onnx) into data/fbank-<front end>/
#   2  tokenizer and map-style packs (cat.stages.driver prepare); the tar shards the
#      experiment streams, in the length groups of its hyper-p.json data.shards, of
#      features or (data.shards.audio) of audio (cat.formats.prep_wds pack-exp; nothing for a
#      map-style experiment); CTC-CRF (config.json trainer.use_crf): the lexicon (phone)
#      tokenizer (hyper-p.json tokenizer.type lexicon) and the denominator graph
#      trainer.den_lm from the training transcripts
#   3  training (exp/<name>/hyper-p.json + config.json)
#   4  decoding and CER scoring
#   5  language models named by hyper-p.json inference.lm (e.g. exp/lm-char-5gram):
#      n-gram training, weights tuned on dev, decoding with shallow fusion / LODR /
#      N-best rescoring, or WFST decoding with TLG (settings with "wfst": the TLG of
#      the lexicon or tokenizer and a word n-gram) -> exp/<name>/RESULTS-lm.md (nothing to
#      do without inference.lm)
#
# Usage (from egs/<corpus>/run.sh):
#   ../../utils/asr.sh --exp exp/ctc-v1 --train_set train --test_sets "dev test" \
#     --speed_perturb 0.9,1.1 --local_data_opts "--aishell_root /data/aishell"
# Every stage skips work that is already done; a failed stage stops the script. The jobs
# run here or on a Slurm cluster as the recipe's cmd.sh says (cmd_backend); SIGINT or
# SIGTERM stops the running stage (training saves first, and a re-run resumes it).
set -euo pipefail
utils=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=stage_lib.sh
. "$utils/stage_lib.sh"

stage=0                 # first stage to run
stop_stage=5            # last stage to run
nj=2                    # parallel jobs for features, packing and decoding (cluster jobs on slurm)
nproc=1                 # training processes (GPUs, or CPU processes with gloo; per node on slurm)
exp=                    # experiment directory (required)
train_set=train         # training set under data/
test_sets="dev test"    # other sets under data/ that get features
speed_perturb=          # speed factors added to the training set (e.g. 0.9,1.1)
local_data_opts=        # options of local/data.sh (stage 0)

# Where the jobs run (cmd_backend local or slurm) and with what resources: the recipe's
# cmd.sh, whose settings are options too.
# shellcheck source=../egs/aishell/cmd.sh
. ./cmd.sh
# shellcheck source=parse_options.sh
. "$utils/parse_options.sh"

# Kaldi's $train_cmd and $decode_cmd ("$train_cmd JOB=1:N LOG COMMAND": utils/launch.sh).
# With the local backend the stages run their own process pools and get no --cmd.
train_cmd=$(launcher_cmd "$mem_per_job" "$time_per_job" 0)
decode_cmd=$(launcher_cmd "$mem_per_job" "$time_per_job" "$decode_gpus")
cpu_opts=()
decode_opts=()
train_opts=()
if [ "$cmd_backend" != local ]; then
  cpu_opts=(--cmd "$train_cmd")
  decode_opts=(--cmd "$decode_cmd")
  train_opts=(--cmd "$(launcher_cmd "$train_mem" "$train_time" 0)" --nnodes "$nnodes"
              --gpus-per-node "$gpus_per_node")
fi

if [ -z "$exp" ]; then
  echo "$0: --exp is required (an experiment directory holding hyper-p.json)" >&2
  exit 1
fi
log "Stages $stage-$stop_stage of $exp: train_set=$train_set test_sets='$test_sets'" \
  "speed_perturb='$speed_perturb' nj=$nj nproc=$nproc cmd_backend=$cmd_backend"

if [ "$stage" -le 0 ] && [ "$stop_stage" -ge 0 ]; then
  log "Stage 0: data preparation (local/data.sh $local_data_opts)"
  # shellcheck disable=SC2086  # the options are words
  bash local/data.sh $local_data_opts
fi

if [ "$stage" -le 1 ] && [ "$stop_stage" -ge 1 ]; then
  log "Stage 1: fbank features"
  # Only the feature dirs the experiment reads: none for a training set packed as audio.
  needed=$(python -m cat.stages.driver feature-dirs "$exp")
  # The experiment's front end (hyper-p.json data.front_end): Kaldi's in data/fbank, another
  # in data/fbank-<front end>.
  front_end=$(python -m cat.stages.driver front-end "$exp")
  fbank=data/fbank
  [ "$front_end" = kaldi ] || fbank=data/fbank-$front_end
  for part in "$train_set" $test_sets; do
    out=$fbank/$part
    opts=()
    [ "$front_end" = kaldi ] || opts=(--front-end "$front_end")
    if [ "$part" = "$train_set" ] && [ -n "$speed_perturb" ]; then
      out=$fbank/${part}_sp
      opts+=(--speed-perturb "$speed_perturb")
    fi
    if ! grep -qxF "$out" <<<"$needed"; then
      log "  $out: not read by $exp (hyper-p.json data), not extracted"
      continue
    fi
    signature="$(cat data/.prepare.done) ${opts[*]}"
    if is_done "$out/.done" "$signature"; then
      log "  $out already extracted"
      continue
    fi
    run python -m cat.features.extract --nj "$nj" "${cpu_opts[@]}" "${opts[@]}" "data/$part" "$out"
    mark_done "$out/.done" "$signature"
  done
fi

if [ "$stage" -le 2 ] && [ "$stop_stage" -ge 2 ]; then
  log "Stage 2: tokenizer, packs and shards for $exp"
  run python -m cat.stages.driver prepare "$exp"
  run python -m cat.formats.prep_wds pack-exp "$exp" --nj "$nj" "${cpu_opts[@]}"
fi

if [ "$stage" -le 3 ] && [ "$stop_stage" -ge 3 ]; then
  log "Stage 3: training $exp"
  run python -m cat.stages.driver train "$exp" --nproc "$nproc" "${train_opts[@]}"
fi

if [ "$stage" -le 4 ] && [ "$stop_stage" -ge 4 ]; then
  log "Stage 4: decoding and scoring $exp"
  run python -m cat.stages.driver decode "$exp" --nj "$nj" "${decode_opts[@]}"
  cat "$exp/RESULTS.md"
fi

if [ "$stage" -le 5 ] && [ "$stop_stage" -ge 5 ]; then
  log "Stage 5: language models and decoding $exp with them"
  run python -m cat.stages.driver lm "$exp" --nj "$nj" "${decode_opts[@]}"
fi
log "Done: stages $stage-$stop_stage"
