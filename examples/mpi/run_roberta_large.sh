#!/bin/bash
# ChainerMN-style data parallel RoBERTa-large under mpiexec: one MPI rank per GPU, the
# gradients all-reduced hierarchically (reduce-scatter in the node over NCCL, all-reduce
# across nodes in fp16 through mpi4py, all-gather in the node) and double-buffered: the
# update at step t applies the averaged gradients of step t-1, so communication overlaps
# the next step's computation. Settings of AWS's RoBERTa recipe (examples/roberta_large.toml).
#
# Run on the first node of the hostfile, from the distlm checkout on the shared file system:
#   examples/mpi/run_roberta_large.sh
# Settings, as environment variables (the defaults are the real run):
#   HOSTFILE        Open MPI hostfile, one "ADDRESS slots=N" line per node
#   RANKS_PER_NODE  ranks (GPUs) per node
#   DATA            fairseq-preprocess directory; empty: distlm's built-in corpus
#   SAVE_DIR        checkpoints, on a file system every node shares
#   VENV            Python environment on the shared file system; empty: the python on PATH
#   CLUSTER         distlm.plan profile the doctor compares the all-reduce bandwidth with;
#                   empty: no verdict
#   ARCH, MAX_UPDATE, CONFIG, DEVICE, NETWORK, and EXTRA_ARGS (more distlm.train flags)
set -euo pipefail

HOSTFILE=${HOSTFILE:-examples/mpi/hostfile}
RANKS_PER_NODE=${RANKS_PER_NODE:-8}
DATA=${DATA-/fsx/data/wikibooks-bin}
SAVE_DIR=${SAVE_DIR:-/fsx/checkpoints/roberta-large-mpi}
VENV=${VENV-/fsx/envs/distlm}
ARCH=${ARCH:-roberta_large}
MAX_UPDATE=${MAX_UPDATE:-500}
CONFIG=${CONFIG:-examples/roberta_large.toml}
DEVICE=${DEVICE:-cuda}
# EFA for NCCL: distlm's preset (logged once; a variable already set wins), no FI_* here.
NETWORK=${NETWORK:-efa}
CLUSTER=${CLUSTER-p3dn.24xlarge}
read -ra extra_args <<< "${EXTRA_ARGS:-}"

nodes=$(grep -cEv '^[[:space:]]*(#|$)' "$HOSTFILE")
# The same absolute path on every node: mpiexec starts remote ranks without this shell's PATH.
if [[ -n $VENV ]]; then
  python=$VENV/bin/python
else
  python=$(command -v python)
fi
mkdir -p "$SAVE_DIR"

on_every_rank() {
  mpiexec -n $((nodes * RANKS_PER_NODE)) --npernode "$RANKS_PER_NODE" --hostfile "$HOSTFILE" "$python" "$@"
}

# --comm-transport mpi: the inter-node leg of the hierarchical hook goes through mpi4py
# (pip install 'distlm[mpi]', built against the Open MPI that runs it).
train_args=(
  ${DATA:+"$DATA"} --config "$CONFIG" --arch "$ARCH" --max-update "$MAX_UPDATE"
  --device "$DEVICE" --network "$NETWORK"
  --comm-hook hierarchical-fp16 --double-buffering --comm-transport mpi
  --save-dir "$SAVE_DIR" "${extra_args[@]}"
)

# Preflight on the very same ranks with the very same flags: GPUs, shared storage, EFA,
# all-reduce bandwidth. A failed check ends the run here, before the nodes spend hours.
on_every_rank -m distlm.doctor ${CLUSTER:+--cluster "$CLUSTER"} "${train_args[@]}"
on_every_rank -m distlm.train "${train_args[@]}"
