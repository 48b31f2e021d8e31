"""The CPU kernels (C++ built on first use by native.py) and the layers over them: linear layers
for float weights (cpu_linear) and 4-/8-bit blocks (block_linear), FBGEMM's (quantized), paged decode
attention and K/V writes (paged_decode), and whole decoder layers for decode steps (decoder_layer)."""
