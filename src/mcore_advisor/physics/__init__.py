"""Physics: FLOPs, per-GPU memory and step time of a plan, and evaluate_plan that combines them with the validators. Pure: no I/O."""
