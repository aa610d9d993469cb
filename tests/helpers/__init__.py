"""Shared test helpers: the tiny chat target and training runs. The oracles and the random
row makers live in the package (``speculators_peagle_plugin.selftest``): the selftest
runs them too."""
