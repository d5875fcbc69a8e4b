set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
T0=$(date +%s)
timeout 220 python3 -m pytest -q -m gpu tests/rollout/test_triton_attention.py tests/rollout/test_engine.py tests/rollout/test_layer_back.py -x -rA 2>&1 | grep -E "PASS|FAIL|Error|error|passed|failed" | head -40
echo "tests took $(( $(date +%s) - T0 )) s"
timeout 340 python3 bench/rollout.py --shapes 0.5b,1.5b --batches 64,256 --hf-batches "" --samplers triton --compile-batch 256 --variants rope-outside,same --out $OUT/rollout-rope-s22.json 2>&1 | grep -v Warning | tail -40
echo "total $(( $(date +%s) - T0 )) s"
