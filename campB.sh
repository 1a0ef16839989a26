nvidia-smi --query-gpu=name --format=csv,noheader
timeout 280 python scripts/bench_throughput.py --config configs/gpt_1b.py --modes blockwise_parallel --seq_lens 32768 --tokens_per_step 32768 --micro_batch_tokens 16384 --chunks 1024 --steps 3 --out $OUT/h32 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tail -12
timeout 290 python scripts/bench_throughput.py --config configs/gpt_1b.py --modes blockwise_parallel --seq_lens 65536 --tokens_per_step 65536 --micro_batch_tokens 16384 --chunks 1024 --steps 3 --out $OUT/h64 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tail -12
