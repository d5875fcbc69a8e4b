"""Run operations: checkpoints of the trainer's state, the monitor and its operating rules, the profiler, the
run lock, stopping on signals, non-finite handling and batch dumps. Knows nothing of losses or the loop."""
