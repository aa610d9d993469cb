"""Training a draft: the config (:mod:`.train_config`, composed of sections owned by the modules
that use them), the P-EAGLE trainer module, one step, checkpoints, the loop.

Modules: ``train_config``, ``peagle_trainer`` (seed API), ``batch`` / ``plan`` / ``metrics`` /
``draft_loss`` (its parts; the last the draft's forward and loss, compiled as one region on
CUDA), ``algorithm`` (entry points), ``optim`` (optimizer and scheduler sections),
``distributed`` (ranks, wrappers; the ``runtime`` section), ``step``, ``checkpoint`` /
``schedule`` / ``validation`` (each a part of the ``trainer`` group), ``provenance`` (how a
checkpoint was made, for its model card), ``progress`` (the step record, the metrics log),
``online`` (the ``online`` section), ``online_data`` (a run's online data), ``served`` (rows'
states from vLLM servers), ``heldout`` (held-out scoring), ``prefetch``, ``loop`` (with
``weights_start`` and ``run_data``, its first two steps), ``pretrained`` (starting from a
trained draft), ``speculators_keys`` (speculators' ``train`` YAML), ``trackers`` (metric
trackers; the ``logging`` section).
"""
