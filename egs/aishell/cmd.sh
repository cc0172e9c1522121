# shellcheck shell=bash disable=SC2034  # the settings are read by ../../utils/asr.sh
# Where this recipe's jobs run (Kaldi's and ESPnet's cmd.sh). ../../utils/asr.sh sources it
# before reading its options, so each setting is also an option of run.sh
# (`bash run.sh --cmd_backend slurm --partition cpu`), and builds $train_cmd and
# $decode_cmd from them (utils/launch.sh, cat.core.launch).
#
#   local  everything runs on this machine: stages 1, 2, 4 and 5 in process pools of --nj
#          processes, training as --nproc processes (torchrun)
#   slurm  stages 1, 2, 4 and 5 run as Slurm array jobs of --nj tasks (sbatch --array), a
#          log per task; training is one job of --nnodes nodes (a rank per GPU, or --nproc
#          CPU ranks per node) that requeues itself when preempted or near its time limit;
#          a user's scancel (or Ctrl-C / SIGTERM to run.sh) ends it for good
#
# To use your cluster: cmd_backend=slurm, your partition, and the sbatch options your site
# needs (account, QOS, constraints) in sbatch_options. The machine running run.sh needs
# Slurm's commands (sbatch, squeue, scontrol, scancel); the nodes must see this checkout,
# tools/venv and the data at the same paths.

cmd_backend=local       # local or slurm
partition=              # Slurm partition of every job ("": the cluster's default)
cpus_per_job=1          # CPUs of each job of stages 1, 2, 4 and 5, and of each training rank
mem_per_job=4G          # memory of each job of stages 1, 2, 4 and 5 (sbatch --mem)
time_per_job=4:00:00    # time limit of each job of stages 1, 2, 4 and 5 (sbatch --time)
decode_gpus=0           # GPUs of each decoding job (stages 4 and 5)
nnodes=1                # nodes of the training job (slurm)
gpus_per_node=0         # GPUs per node of the training job, a rank each (0: --nproc CPU ranks)
train_mem=32G           # memory per node of the training job
train_time=2-00:00:00   # time limit of each run of the training job (it requeues itself)
sbatch_options=         # further sbatch options of every job, e.g. "--account=asr --qos=normal"
