"""Diagnosis: Megatron log parsing, MFU/HFU checks, and the low-MFU and OOM diagnoses. Pure: no I/O."""
