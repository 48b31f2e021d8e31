"""The engine through its public API: launch and fetch from threads, lifecycle, faults, sampling,
constraints, the prefix cache, stress and correctness against transformers."""
