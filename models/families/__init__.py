"""The model families in plain torch, one file each: llama.py (Llama, Qwen2/3, Mistral, Phi-3,
Mixtral, Qwen3-MoE), gpt2.py, gemma.py (Gemma 1, 2 and 3), olmo.py, lfm2.py (LFM2's
short convolutions beside attention), and the parts they share (layers, rope, moe)."""
