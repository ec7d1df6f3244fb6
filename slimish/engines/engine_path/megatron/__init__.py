"""What an SGLang engine process finds when it imports `megatron` (`engine_env` puts this folder first on the
engine's PYTHONPATH): nothing. SGLang's debug dumper (sglang/srt/debug_utils/dumper.py, `_MegatronPlugin`) imports
Megatron-Core whenever it is installed, as it is beside every engine of ours: 7 s of CPU (measured on the CPU
machine) in every scheduler process, for a plugin that the engines never use. The dumper catches the ImportError."""

raise ImportError("Megatron-Core is hidden from SGLang engine processes (slimish.engines.server.engine_env)")
