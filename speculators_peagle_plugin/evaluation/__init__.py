"""Evaluating drafts in vLLM's parallel drafting: acceptance, speed, the K to serve.

Modules: ``config`` (:class:`~.config.EvalConfig` and its ``sweep`` section), ``harness``
(the sweep), ``cells`` (finished cells kept across runs), ``report`` (the record and its
provenance), ``recommend`` (the K per concurrency), ``plots``.
"""
