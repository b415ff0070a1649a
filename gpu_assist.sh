set -x
export PYTHONPATH=$PWD TORCHINDUCTOR_CACHE_DIR=/tmp/ind
python -m pip install -q --no-index --find-links wheelhouse liger-kernel tqdm 2>&1 | tail -2
python -c "import transformers, liger_kernel; print('transformers', transformers.__version__)"
nvidia-smi --query-gpu=name --format=csv
timeout 560 python benchmarks/bench_assistant.py --phase "$PHASES" --out $OUT --rep-ms 200 $EXTRA 2>&1 | grep -v "UserWarning\|warnings.warn" > $OUT/log.txt
echo rc=$?
tail -c 11000 $OUT/log.txt
