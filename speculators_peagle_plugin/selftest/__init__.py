"""``speculators-peagle selftest``: the kernels and the training step, proven on this machine.

Correctness against float64 CPU oracles (:mod:`.checks`), the step's speed and memory
beside speculators' built-in P-EAGLE (:mod:`.perf`), the step under torchrun
(:mod:`.distributed_checks`); :mod:`.command` runs them and reports.
"""
