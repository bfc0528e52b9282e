#!/usr/bin/env bash
# BERT-tiny phase 1 throughput: mpitrain, Horovod, Gloo at 1, 2, 4 ranks, interleaved.
cd /work/main
COMMON="--max-steps 30 --timing-skip 5 --checkpoint-every 0 --no-progress"
for round in 1 2; do
for np in 1 2 4; do
  for fw in mpitrain horovod gloo; do
    rm -rf /tmp/bq-$fw
    if [ $fw = horovod ]; then
      out=$(env PYTHONPATH=src .venv-horovod/bin/mpirun --allow-run-as-root --oversubscribe -np $np .venv-horovod/bin/python examples/pytorch/bert_pretraining.py --backend horovod $COMMON --output-dir /tmp/bq-$fw 2>&1 | grep "throughput")
    else
      out=$(.venv/bin/mpirun --allow-run-as-root --oversubscribe -np $np .venv/bin/python examples/pytorch/bert_pretraining.py --backend $fw $COMMON --output-dir /tmp/bq-$fw 2>&1 | grep "throughput")
    fi
    echo "round $round np $np $fw: $out  load $(cut -d' ' -f1 /proc/loadavg)"
  done
done
done
