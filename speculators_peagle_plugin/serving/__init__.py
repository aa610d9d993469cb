"""Serving a draft: check a checkpoint against what vLLM loads, and export it.

Modules: ``draft_checkpoint`` (reading one), ``check_config`` / ``check_target`` /
``check_weights`` (the rules), ``check`` (running them), ``export``, ``model_card`` (the
draft's ``README.md``).
"""
