"""Helpers beside the benchmarks, measuring nothing themselves: ``prepare_gpu`` readies a bare
GPU machine for ``selftest --device cuda``; ``extend_prompts`` writes the prompts of a larger
spec after a long run's own, for ``eval.scaling --more-data``."""
