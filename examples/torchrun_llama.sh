#!/bin/bash
# Llama-style causal LM on one 8-GPU node with torchrun (bf16 needs an Ampere or newer GPU).
torchrun --nproc_per_node 8 -m distlm.train /fsx/data/llama-bin \
  --arch llama_tiny --task causal_lm --tokens-per-sample 2048 --batch-size 4 \
  --device cuda --bf16 --lr 3e-4 --lr-scheduler cosine --warmup-updates 2000 --max-update 100000
