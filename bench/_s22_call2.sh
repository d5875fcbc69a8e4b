python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
T0=$(date +%s)
timeout 240 python3 -m pytest -q -m gpu tests/rollout/test_engine.py tests/rollout/test_layer_back.py tests/bench/test_decode_kernels.py -rA 2>&1 | grep -E "^PASS|^FAIL|Error|passed|failed" | head -40
echo "tests took $(( $(date +%s) - T0 )) s"
timeout 200 python3 bench/decode_kernels.py --parts gateup --shapes 0.5b,1.5b --batches 64,256 --sweep --out $OUT/gateup-s22.json 2>&1 | grep -v "^{" | tail -40
echo "gateup done at $(( $(date +%s) - T0 )) s"
timeout 130 python3 bench/rollout.py --shapes 0.5b --batches 256 --hf-batches "" --no-hf-compile --samplers triton --profile --profile-batches 256 --out $OUT/rollout-profile-s22.json 2>&1 | grep -v Warning | tail -45
echo "total $(( $(date +%s) - T0 )) s"
