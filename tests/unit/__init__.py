"""Parts of the runtime alone: the scheduler over a KV manager, the sampler, the KV pool, the CPU host's
thread count and OpenMP handling."""
