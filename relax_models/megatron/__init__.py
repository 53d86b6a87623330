"""megatron-core support for the Qwen3 families: model construction from an HF config (``model``), the
HF <-> Megatron weight bridge (``bridge``) and the CPU compatibility shim (``cpu_shim``).

Importing this package does not import megatron-core; the modules do, lazily where they can.
"""
