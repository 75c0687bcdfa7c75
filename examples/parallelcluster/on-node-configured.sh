#!/bin/bash
# OnNodeConfigured action of the ParallelCluster configurations in this folder. It runs
# as root on every node once ParallelCluster has configured it (FSx for Lustre mounted).
#
#   on-node-configured.sh STACK ROLE WHEEL_FOLDER
#     STACK         p3dn | p4d | trn1 | trn2: the instance family of the compute nodes
#     ROLE          head | compute
#     WHEEL_FOLDER  s3:// folder holding the distlm wheel (README.md shows how to put it there)
#
# The head node builds one Python environment on the shared file system (DISTLM_ENV,
# default /fsx/envs/distlm), so every compute node runs the very same packages without
# installing any. ParallelCluster finishes the head node before it starts compute nodes.
# Compute nodes install only what lives outside Python: on trn nodes the Neuron driver,
# runtime, collectives and tools. ParallelCluster's own Ubuntu 24.04 image already has the
# NVIDIA driver, CUDA and the EFA software with AWS's Open MPI in /opt/amazon/openmpi.
#
# DRY_RUN=1 prints the commands instead of running them.
set -euo pipefail

usage="usage: on-node-configured.sh p3dn|p4d|trn1|trn2 head|compute s3://BUCKET/FOLDER/"
if [[ $# -ne 3 ]]; then
  echo "$usage" >&2
  exit 2
fi
STACK=$1 ROLE=$2 WHEEL_FOLDER=${3%/}
DISTLM_ENV=${DISTLM_ENV:-/fsx/envs/distlm}
NEURON_PIP_INDEX=https://pip.repos.neuron.amazonaws.com
# Trainium nodes need no CUDA: torch comes from PyTorch's CPU index, not PyPI's CUDA build.
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

case $STACK in
  # V100 (sm_70) kernels are only in PyTorch's CUDA 12.6 builds; PyPI's default build has none.
  p3dn) python_packages=(torch==2.13.0+cu126 --extra-index-url https://download.pytorch.org/whl/cu126) ;;
  p4d) python_packages=(torch==2.13.0) ;;
  # TorchNeuron, the native PyTorch backend (Neuron 2.33 and later): distlm --device neuron.
  trn2) python_packages=("torch-neuronx==2.13.*" "neuronx-cc==2.*" nki
                         --extra-index-url "$NEURON_PIP_INDEX" --extra-index-url "$TORCH_CPU_INDEX") ;;
  # trn1 has no TorchNeuron: the torch-xla stack of Neuron 2.31, the last release that ships
  # it (torch 2.9): distlm --device xla.
  trn1) python_packages=(neuronx-cc==2.26.6360.0 torch-neuronx==2.9.0.2.15.32035
                         --extra-index-url "$NEURON_PIP_INDEX" --extra-index-url "$TORCH_CPU_INDEX") ;;
  *) echo "STACK $STACK is not one of p3dn, p4d, trn1, trn2; $usage" >&2; exit 2 ;;
esac
if [[ $ROLE != head && $ROLE != compute ]]; then
  echo "ROLE $ROLE is not head or compute; $usage" >&2
  exit 2
fi
if [[ $WHEEL_FOLDER != s3://* ]]; then
  echo "WHEEL_FOLDER $WHEEL_FOLDER is not an s3:// folder; $usage" >&2
  exit 2
fi

# Wait for the dpkg lock instead of failing while unattended-upgrades holds it after boot.
apt_get=(apt-get -o DPkg::Lock::Timeout=600 -y)
export DEBIAN_FRONTEND=noninteractive

run() {
  if [[ -n ${DRY_RUN:-} ]]; then
    echo "+ $*"
  else
    "$@"
  fi
}

install_neuron_system_packages() {
  # The Neuron apt repository, then the kernel driver and the runtime the framework calls.
  . /etc/os-release
  run install -m 0755 -d /etc/apt/keyrings
  local repo=https://apt.repos.neuron.amazonaws.com keyring=/etc/apt/keyrings/neuron.gpg
  run sh -c "wget -qO - $repo/GPG-PUB-KEY-AMAZON-AWS-NEURON.PUB | gpg --batch --yes --dearmor -o $keyring"
  run sh -c "echo 'deb [signed-by=$keyring] $repo ${VERSION_CODENAME} main' > /etc/apt/sources.list.d/neuron.list"
  run "${apt_get[@]}" update
  run "${apt_get[@]}" install "linux-headers-$(uname -r)" \
    "aws-neuronx-dkms=2.*" "aws-neuronx-runtime-lib=2.*" "aws-neuronx-collectives=2.*" "aws-neuronx-tools=2.*"
  run sh -c "echo 'export PATH=/opt/aws/neuron/bin:\$PATH' > /etc/profile.d/neuron.sh"
}

build_shared_environment() {
  local wheels=/tmp/distlm-wheels wheel
  run "${apt_get[@]}" update
  run "${apt_get[@]}" install python3-venv python3-dev
  run python3 -m venv "$DISTLM_ENV"
  run "$DISTLM_ENV/bin/python" -m pip install --no-cache-dir --upgrade pip
  run aws s3 cp --recursive --exclude "*" --include "distlm-*.whl" "$WHEEL_FOLDER/" "$wheels/"
  wheel=
  if [[ -d $wheels ]]; then
    wheel=$(find "$wheels" -name "distlm-*.whl" | sort -V | tail -n 1)
  fi
  if [[ -z $wheel && -z ${DRY_RUN:-} ]]; then
    echo "no distlm-*.whl in $WHEEL_FOLDER/; upload one as README.md shows" >&2
    exit 1
  fi
  # The wheel's own requirements (numpy, safetensors, tqdm, torch>=2.6) resolve together
  # with the accelerator's torch in one pip run.
  run "$DISTLM_ENV/bin/python" -m pip install --no-cache-dir \
    "${wheel:-$wheels/distlm-VERSION.whl}" "${python_packages[@]}"
  case $STACK in
    # mpi4py compiled against AWS's Open MPI, which carries EFA: the mpiexec kit's transport.
    p3dn|p4d) run env MPICC=/opt/amazon/openmpi/bin/mpicc \
                "$DISTLM_ENV/bin/python" -m pip install --no-cache-dir --no-binary mpi4py "mpi4py>=3.1" ;;
  esac
  run chmod -R a+rX "$DISTLM_ENV"
  run rm -rf "$wheels"
}

case $ROLE in
  head) build_shared_environment ;;
  compute) if [[ $STACK == trn* ]]; then install_neuron_system_packages; fi ;;
esac
echo "distlm node set-up done: $STACK $ROLE (environment $DISTLM_ENV)"
