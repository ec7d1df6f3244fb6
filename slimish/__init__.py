"""slimish: RL post-training native to Megatron-Core (training) and SGLang (rollout)."""

__version__ = "0.1.0"
