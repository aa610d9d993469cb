"""Making training data: the target's replies, their hidden states, ``generate-data``.

Modules: ``datagen_config`` (``DataGenConfig``), ``generation`` (the target's replies,
transformers or vLLM), ``turn_state`` (the finished conversations' shards and the finished
turns of multi-turn ones, kept across a stop), ``capture`` (hidden states with
transformers), ``capture_vllm`` (with vLLM: placing the replies' engine's recordings, or a
prefill pass), ``vllm_recorder`` (the worker extension that records while vLLM generates)
and ``vllm_connector`` (the KV connector of the prefill pass), both loaded by vLLM in its
worker, ``build_data`` (``generate_data``), ``output`` (its output directory: checked,
locked, sized; the dataset written), ``online_states`` (states the target computes as
training reads the rows), ``served_states`` (states from running vLLM servers: the
``generation`` section), ``vllm_servers`` (reaching those servers), ``shard_plan`` (which
conversations a part of the data makes: ``--shard``, replicas), ``replicas``
(``--data-parallel-size``) and ``join`` (``join-data``: the parts joined). Nothing is
imported here: importing a generator is the caller's choice.
"""
