"""The closed loop (`metainfer loop init|judge|run|tune`, docs/loop.md).

config / template: loop.toml, read and written;  tamper: what a candidate may not touch;
judge: one candidate against its base, by the base's oracle and bench (ab: the verdict rule);
record: a verdict as a KB record;  run, brief, report: the agent loop;  tune, tune_gpu: the autotuner;
gitops: the git operations;  cli: the commands.
"""
