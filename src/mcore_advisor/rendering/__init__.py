"""Rendering: the Plan -> Megatron argument table, the launch-script renderer and its templates. Pure: no I/O besides reading the packaged templates."""
