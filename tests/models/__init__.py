"""The model side: the kernels, weight formats, checkpoints (GGUF, Hugging Face) and families."""
