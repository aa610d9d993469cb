"""The demo (``speculators-peagle demo``): SmolLM2-135M's own replies -> a P-EAGLE draft ->
acceptance in vLLM, on a CPU, in resumable stages.

Modules: ``demo_config`` (:class:`~.demo_config.DemoConfig`, which composes the ``replies`` and
``sweep`` sections of generate-data and eval), ``pipeline`` (the stages), ``stages`` (their
record), ``artifacts`` (prompts and drafts it writes), ``smollm2`` (the target), ``summary``.
"""
