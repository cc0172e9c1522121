#!/usr/bin/env bash
# Kaldi's run.pl and slurm.pl in one: run a command once per task of an array, locally or
# as a Slurm array job (cat.core.launch). The recipes' $train_cmd and $decode_cmd (built
# from cmd.sh by utils/asr.sh) start with it.
#
# Usage: launch.sh [--backend local|slurm] [--partition P] [--cpus-per-job N]
#                  [--mem-per-job M] [--gpus-per-job G] [--time-per-job T]
#                  [--sbatch-option=OPTION ...] JOB=1:N LOG COMMAND...
#   launch.sh --backend slurm --mem-per-job 4G JOB=1:4 exp/x/log/work.JOB.log python work.py JOB
set -euo pipefail
exec python -m cat.core.launch "$@"
