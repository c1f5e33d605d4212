#!/usr/bin/env bash
# The ring attention figures of docs/distributed.md (issue 17), on this one machine:
#   1. overlap: B=1 H=8 D=64 L=32768 over 2 ranks in two network namespaces joined by a veth
#      pair limited to RATE (default 125mbit: one 8 MiB K/V block's transfer takes about as
#      long as its compute with one core per rank) - tests/mpi/netns_ring.sh with its overrides
#   2. load balance: causal L=32768 over 2 ranks, contiguous against zigzag (one namespace)
#   3. memory: L=65536 over 4 ranks (causal, zigzag), default blocks and whole-shard blocks
#   4. backward overlap: as 1 for ring_attention_backward over a 70 Mbit/s link (its messages
#      carry K/V and the dk/dv sums, twice the forward's bytes for f32, against 2.5x the work)
# Prints qkv ring-bench's tables. Needs root (network namespaces) and a quiet machine: other
# load steals the cores the ranks time on. About 17 minutes on 2 cores.
#
#   scripts/bench_ring.sh [QKV_BINARY] [RATE]
set -euo pipefail
cd "$(dirname "$0")/.."
qkv=${1:-$PWD/build/release/qkv}
rate=${2:-125mbit}
python=$PWD/.cache/venv-test/bin/python
[[ -x $python ]] || python=python3
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
lscpu | grep -m1 'Model name'

echo "== 1. overlap over a $rate link, B=1 H=8 D=64 L=32768, 2 ranks"
RING_RATE=$rate RING_BENCH="--shape 1,8,8,32768,64 --repeats 1" \
  tests/mpi/netns_ring.sh "$qkv" "$python" | grep 'netns_ring: (b)'

echo "== 2. causal load balance, B=1 H=8 D=64 L=32768, 2 ranks, 1 thread each"
for layout in contiguous zigzag; do
  mpirun -np 2 -x OMP_NUM_THREADS=1 "$qkv" ring-bench --shape 1,8,8,32768,64 --causal \
    --ring-layout "$layout" --threads 1 --repeats 3
done

echo "== 3. memory per rank, B=1 H=8 D=64 L=65536 causal zigzag, 4 ranks on the cores there are"
for block in 0 16384; do
  mpirun -np 4 -x OMP_NUM_THREADS=1 "$qkv" ring-bench --shape 1,8,8,65536,64 --causal \
    --ring-layout zigzag --ring-block "$block" --threads 1 --repeats 1
done

echo "== 4. backward overlap over a ${BACKWARD_RATE:-70mbit} link, B=1 H=8 D=64 L=32768, 2 ranks"
RING_RATE=${BACKWARD_RATE:-70mbit} RING_BENCH="--shape 1,8,8,32768,64 --repeats 1 --backward" \
  tests/mpi/netns_ring.sh "$qkv" "$python" | grep 'netns_ring: (b)'
