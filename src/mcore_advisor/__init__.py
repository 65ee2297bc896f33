"""mcore-advisor: plan, check, launch and profile Megatron-Core training runs."""

__version__ = "0.1.0"
