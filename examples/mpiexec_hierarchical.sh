#!/bin/bash
# ChainerMN-style run: 4 nodes x 8 ranks under Open MPI, hierarchical all-reduce with
# the inter-node leg in fp16 through mpi4py, communication double-buffered (one-step-stale
# gradients). mpiexec exports no master address: distlm agrees on one through mpi4py.
# Needs: pip install 'distlm[mpi]'.
mpiexec -n 32 -N 8 --hostfile hosts.txt \
  python -m distlm.train /fsx/data/wikibooks-bin --config examples/roberta_large.toml \
  --comm-hook hierarchical-fp16 --comm-transport mpi --double-buffering
