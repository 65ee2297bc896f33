"""Planning: the layout search, recommend_parallelism's ranking and explanations, and the candidate plan changes. Pure: no I/O."""
