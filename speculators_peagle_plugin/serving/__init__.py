"""Serving a draft: check a checkpoint against what vLLM loads, and export it.

Modules: ``draft_checkpoint`` (reading one), ``check_config`` / ``check_target`` /
``check_weights`` / ``check_card`` (the rules; the card itself is
:mod:`..model.model_card`), ``check`` (running them), ``export``.
"""
