#!/bin/bash
# Open MPI's mpirun: N hosts x G GPUs, one MPI process per GPU.
# SCRIPT=examples/finetune.py runs the fine-tune job instead of examples/train.py (pass --checkpoint_dir DIR as an
# argument); both take the same launch options.
#
#   HOSTS=node1:8,node2:8 NODES=2 GPUS_PER_NODE=8 bash examples/launch/mpirun.sh
#
# Lightning picks its MPIEnvironment when mpi4py imports and MPI.COMM_WORLD has more than one process (and neither
# torchrun, SLURM nor jsrun was detected first). It needs `pip install mpi4py`, built against the MPI that provides
# mpirun. Everything comes from MPI itself, no variables:
#   world size and global rank   MPI.COMM_WORLD
#   node rank                    index of this host's name in the sorted list of all ranks' host names
#   local rank (-> cuda:N)       rank among the processes on the same host
#   MASTER_ADDR / MASTER_PORT    rank 0's host name and a free port it picks, broadcast over MPI (so rank 0's host
#                                name must resolve on every node)
# MPIEnvironment does not check devices x nodes: pass --devices and --num_nodes (your script: Fabric(devices=G,
# num_nodes=N)); HybridFSDPStrategy stops with the arithmetic if they don't match the world size.
#
# * --map-by slot fills one host before the next, so consecutive ranks share a node, which HSDP shards over;
#   --map-by node would alternate hosts and put every shard group across the slow link.
# * -x forwards variables to the remote ranks (PATH for the venv, NCCL_* if you set them).
# MPICH/Intel MPI (hydra): mpiexec -n $((NODES * GPUS_PER_NODE)) -ppn $GPUS_PER_NODE -hosts node1,node2 -genvall ...
set -euo pipefail
: "${HOSTS:?set HOSTS, e.g. node1:8,node2:8}"
NODES=${NODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}

mpirun -np $((NODES * GPUS_PER_NODE)) -H "$HOSTS" --map-by slot --bind-to none \
    -x PATH -x LD_LIBRARY_PATH -x PYTHONPATH \
    python "${SCRIPT:-examples/train.py}" --accelerator cuda --devices "$GPUS_PER_NODE" --num_nodes "$NODES" \
    --precision bf16-mixed --out_dir out/mpi-hsdp "$@"
