"""What an SGLang engine process finds when it imports `wandb` (`engine_env` puts this folder first on the engine's
PYTHONPATH): nothing. SGLang's model registry imports every model module at each start; one of them loads
transformers' Gemma3n configuration, which imports timm, which tries `import wandb` whenever it is installed, as it
is beside every engine of ours (slimish's metrics log to W&B): W&B's SDK is among the slowest imports of an engine's
start, for a logger that the engines never use. timm catches the ImportError."""

raise ImportError("Weights & Biases is hidden from SGLang engine processes (slimish.engines.server.engine_env)")
