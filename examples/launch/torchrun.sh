#!/bin/bash
# torchrun with the c10d rendezvous: run this same command on every node (ssh, pdsh, your scheduler).
# SCRIPT=examples/finetune.py runs the fine-tune job instead of examples/train.py (pass --checkpoint_dir DIR as an
# argument); both take the same launch options.
#
#   RDZV_HOST=node1 NNODES=2 GPUS_PER_NODE=8 JOB_ID=run42 bash examples/launch/torchrun.sh     # on each node
#   # one torchrun per node of a SLURM allocation (the tasks inherit these variables):
#   RDZV_HOST=$(scontrol show hostnames | head -1) JOB_ID=$SLURM_JOB_ID \
#       srun --nodes=2 --ntasks-per-node=1 bash examples/launch/torchrun.sh
#
# No --node-rank and no --master-addr: the nodes meet at RDZV_HOST:RDZV_PORT (a c10d store that the node whose
# address it is hosts) and get their node ranks there, in order of arrival. torchrun then sets, for each process:
#   WORLD_SIZE, RANK (consecutive on a node: node rank * GPUS_PER_NODE + LOCAL_RANK), LOCAL_RANK (-> cuda:N),
#   LOCAL_WORLD_SIZE, GROUP_RANK (node rank), MASTER_ADDR/MASTER_PORT (host and free port of node rank 0's agent),
#   TORCHELASTIC_RUN_ID
# Lightning picks its TorchElasticEnvironment from TORCHELASTIC_RUN_ID (torch.distributed.is_torchelastic_launched())
# and reads WORLD_SIZE, RANK, LOCAL_RANK, GROUP_RANK, MASTER_ADDR, MASTER_PORT; it wins over the SLURM variables the
# workers inherit under srun. The examples take --devices and --num_nodes from LOCAL_WORLD_SIZE and WORLD_SIZE; your
# own script passes Fabric(devices=G, num_nodes=N).
#
# * Every node must use the same RDZV_HOST:RDZV_PORT and JOB_ID, and reach that port (firewalls).
# * A node whose host name does not resolve on the others: add --local-addr <its reachable IP>.
# * Slow starts (container pulls): raise the rendezvous timeout, --rdzv-conf join_timeout=900.
# * The default static rendezvous instead needs --node-rank R --master-addr HOST --master-port P on each node; a
#   missing --rdzv-backend with --rdzv-endpoint is the usual reason a multi-node torchrun never starts.
# * Node ranks follow the order in which the nodes join, not the host names: use GROUP_RANK, not SLURM_NODEID.
#
# Settings from the environment (defaults for GPUs): ACCELERATOR (cuda), PRECISION (bf16-mixed), OUT_DIR
# (out/torchrun-hsdp), SCRIPT (examples/train.py). tests/cluster/ runs this file on CPU, one torchrun per node
# under srun.
set -euo pipefail
: "${RDZV_HOST:?set RDZV_HOST to a host all nodes reach (e.g. the first node)}"
RDZV_PORT=${RDZV_PORT:-29500}
NNODES=${NNODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
JOB_ID=${JOB_ID:-hsdp-train}

torchrun --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$RDZV_HOST:$RDZV_PORT" --rdzv-id "$JOB_ID" \
    "${SCRIPT:-examples/train.py}" --accelerator "${ACCELERATOR:-cuda}" --precision "${PRECISION:-bf16-mixed}" \
    --out_dir "${OUT_DIR:-out/torchrun-hsdp}" "$@"
