#!/bin/bash
# Open MPI's mpirun: N hosts x G GPUs, one MPI process per GPU.
# SCRIPT=examples/finetune.py runs the fine-tune job instead of examples/train.py (pass --checkpoint_dir DIR as an
# argument); both take the same launch options.
#
#   HOSTS=node1:8,node2:8 NODES=2 GPUS_PER_NODE=8 bash examples/launch/mpirun.sh      # hosts named by hand
#   sbatch --nodes=2 --ntasks-per-node=8 --gres=gpu:8 examples/launch/mpirun.sh        # in a SLURM allocation
#   salloc --nodes=2 --ntasks-per-node=8 --gres=gpu:8 bash examples/launch/mpirun.sh   # the same, interactively
#
# Inside a SLURM (or LSF) allocation leave HOSTS unset: mpirun takes the hosts and slots from the allocation and
# starts its daemons on the other nodes itself (through srun under SLURM), and NODES / GPUS_PER_NODE default to the
# allocation's --nodes / --ntasks-per-node. Arguments after the script go to examples/train.py.
#
# Lightning picks its MPIEnvironment when mpi4py imports and MPI.COMM_WORLD has more than one process, but only after
# torchrun, SLURM and jsrun: inside a SLURM allocation every MPI process inherits SLURM variables (the batch step's,
# or those of the srun step that started Open MPI's daemon) and Lightning alone would pick SLURMEnvironment (ranks
# collide: EADDRINUSE, or WORLD_SIZE 1). HybridFSDPStrategy sees mpirun's variables (OMPI_COMM_WORLD_SIZE and
# OMPI_COMM_WORLD_LOCAL_SIZE; Hydra's PMI_SIZE and MPI_LOCALNRANKS) and uses MPIEnvironment; its start-up log says so.
# MPIEnvironment needs `pip install mpi4py`, built against (or loading) the MPI that provides mpirun. It reads:
#   world size and global rank   MPI.COMM_WORLD
#   node rank                    index of this host's name in the sorted list of all ranks' host names
#   local rank (-> cuda:N)       rank among the processes on the same host
#   MASTER_ADDR / MASTER_PORT    rank 0's host name and a free port it picks, broadcast over MPI (so rank 0's host
#                                name must resolve on every node)
# examples/train.py takes --devices/--num_nodes from OMPI_COMM_WORLD_LOCAL_SIZE and the world size; this script passes
# them anyway. Your own script: Fabric(devices=G, num_nodes=N); the strategy stops every rank with the arithmetic if
# they don't match what mpirun started.
#
# * --map-by slot fills one host before the next, so consecutive ranks share a node, which HSDP shards over;
#   --map-by node would alternate hosts and put every shard group across the slow link.
# * -x forwards variables to the remote ranks (PATH for the venv, NCCL_* if you set them).
# * Open MPI refuses to run as root; containers that run as root set OMPI_ALLOW_RUN_AS_ROOT=1 and
#   OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1. On a machine whose only usable interface is loopback (the CPU tests), also
#   OMPI_MCA_btl_tcp_if_include=lo and OMPI_MCA_oob_tcp_if_include=lo.
# MPICH/Intel MPI (hydra): mpiexec -n $((NODES * GPUS_PER_NODE)) -ppn $GPUS_PER_NODE -hosts node1,node2 -genvall ...
#
# Settings from the environment (defaults for GPUs): ACCELERATOR (cuda), PRECISION (bf16-mixed), OUT_DIR
# (out/mpi-hsdp), VENV (activated if set), SCRIPT (examples/train.py). tests/cluster/ runs this file under sbatch
# and salloc on CPU.
set -euo pipefail
NODES=${NODES:-${SLURM_NNODES:-2}}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_NTASKS_PER_NODE:-8}}
HOST_ARGS=()
if [[ -n "${HOSTS:-}" ]]; then
    HOST_ARGS=(-H "$HOSTS")
elif [[ -z "${SLURM_JOB_ID:-}${LSB_JOBID:-}" ]]; then
    echo "mpirun.sh: set HOSTS (e.g. node1:8,node2:8), or run it inside a SLURM or LSF allocation" >&2
    exit 2
fi
if [[ -n "${VENV:-}" ]]; then
    source "$VENV/bin/activate"
fi

mpirun -np $((NODES * GPUS_PER_NODE)) "${HOST_ARGS[@]}" --map-by slot --bind-to none \
    -x PATH -x LD_LIBRARY_PATH -x PYTHONPATH \
    python "${SCRIPT:-examples/train.py}" --accelerator "${ACCELERATOR:-cuda}" --devices "$GPUS_PER_NODE" \
    --num_nodes "$NODES" --precision "${PRECISION:-bf16-mixed}" --out_dir "${OUT_DIR:-out/mpi-hsdp}" "$@"
