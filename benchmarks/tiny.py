"""What the benchmarks' smoke runs share (`python -m benchmarks.run --tiny`, tests/unit/test_benchmarks.py): each
benchmark runs its own code path, the one `make bench` runs, at sizes that take seconds."""

# The demo's simulated task with a policy that pre-trains in a second and steps of fewer, shorter rollouts.
SIMULATION = {"pretrain_iters": 5, "rl_iters": 1, "rollouts_per_step": 32, "response_len": 24, "step_period_s": 0.0}
# A training of a few packed batches, an evaluation of a few prompts.
TRAIN = {"epochs": 1, "warm_start_epochs": 1, "max_tokens": 1500, "min_samples": 8}
EVAL = {"num_prompts": 4, "max_new_tokens": 8}
