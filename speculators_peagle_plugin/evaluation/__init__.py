"""Evaluating drafts in vLLM's parallel drafting: acceptance, speed, the K to serve.

Modules: ``eval_config`` (:class:`~.eval_config.EvalConfig` and its ``sweep`` section), ``harness``
(the sweep), ``cells`` (finished cells kept across runs), ``report`` (the record and its
provenance), ``recommend`` (the K per concurrency), ``plots``, ``server`` (``eval --server``,
against running vLLM servers), ``card`` (the model card's acceptance section).
"""
