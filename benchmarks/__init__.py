"""Benchmarks runnable from a source checkout, each ``python -m benchmarks.<name>`` from the
repository root: ``compare`` (zero_ray beside DDP, ZeroRedundancyOptimizer, FSDP2 and
DeepSpeed), ``collectives``, ``checkpoint_io``, ``recovery_time``, ``stage3_capacity``,
``stage3_step_time``, ``control_overhead``, ``precision``, ``gpu_check``. What they share is in
``benchmarks.harness``; results go to ``benchmarks/results``. Not installed with zero_ray."""
