#!/bin/bash
# Lightning's `fabric run` on two (or more) nodes: run this on every node with its own NODE_RANK.
# SCRIPT=examples/finetune.py runs the fine-tune job instead of examples/train.py (pass --checkpoint_dir DIR as an
# argument); both take the same launch options.
#
#   NODE_RANK=0 MAIN_ADDRESS=10.0.0.1 bash examples/launch/fabric_run.sh      # on node 0 (10.0.0.1)
#   NODE_RANK=1 MAIN_ADDRESS=10.0.0.1 bash examples/launch/fabric_run.sh      # on node 1
#   # one machine, two simulated CPU nodes (what examples/main_job.py does):
#   ACCELERATOR=cpu GPUS_PER_NODE=2 NODE_RANK=0 MAIN_ADDRESS=127.0.0.1 bash examples/launch/fabric_run.sh &
#   ACCELERATOR=cpu GPUS_PER_NODE=2 NODE_RANK=1 MAIN_ADDRESS=127.0.0.1 bash examples/launch/fabric_run.sh
#
# `fabric run` sets LT_CLI_USED=1, LT_ACCELERATOR, LT_DEVICES, LT_NUM_NODES (and LT_PRECISION with --precision) and
# starts torchrun with a static rendezvous (--nproc_per_node, --nnodes, --node_rank, --master_addr MAIN_ADDRESS,
# --master_port MAIN_PORT), so Lightning picks TorchElasticEnvironment (RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK,
# MASTER_ADDR, MASTER_PORT). In your script:
# * Fabric() already sets up the processes; do not call fabric.launch() (it raises "processes have already been
#   created"). Check `os.environ.get("LT_CLI_USED") == "1"` as examples/launching.py does.
# * Leave accelerator/devices/num_nodes/precision at their defaults in Fabric(...), or pass the same values as on
#   the command line: a different value raises a conflict error. Don't pass --strategy to `fabric run` when the
#   script passes HybridFSDPStrategy(...). For a script with a bare L.Fabric(), `fabric-hsdp run --strategy hsdp
#   ...` takes the same options as `fabric run` (`fabric run --strategy hsdp` fails: Lightning checks the name
#   before fabric_hsdp is imported; see docs/migration.md, which also translates `lightning run model`).
# * Every node: same NUM_NODES, MAIN_ADDRESS (node 0's address, reachable from all nodes) and MAIN_PORT (free on
#   node 0, open in its firewall). Node 0 waits until all nodes have joined.
set -euo pipefail
: "${NODE_RANK:?set NODE_RANK (0 on the main node)}"
: "${MAIN_ADDRESS:?set MAIN_ADDRESS to the address of node 0}"
MAIN_PORT=${MAIN_PORT:-29400}
NUM_NODES=${NUM_NODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
ACCELERATOR=${ACCELERATOR:-cuda}

fabric run --accelerator "$ACCELERATOR" --devices "$GPUS_PER_NODE" --num-nodes "$NUM_NODES" \
    --node-rank "$NODE_RANK" --main-address "$MAIN_ADDRESS" --main-port "$MAIN_PORT" \
    "${SCRIPT:-examples/train.py}" --out_dir out/fabric-hsdp "$@"
