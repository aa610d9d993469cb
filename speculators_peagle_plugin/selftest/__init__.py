"""``speculators-peagle selftest``: the kernels and the training step, proven on this machine.

Correctness against float64 CPU oracles (:mod:`.checks`), the step's speed and memory
beside speculators' built-in P-EAGLE (:mod:`.perf`), the step under torchrun
(:mod:`.distributed_checks`); :mod:`.command` runs them and reports, with the settings of
:mod:`.selftest_config`.

Their parts: ``shapes`` (the drafts it runs), ``rows`` (random packed rows), ``oracles``
(the float64 references), ``selftest_report`` (a check's verdict, the stack, the record).
"""
