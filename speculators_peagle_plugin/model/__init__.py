"""The P-EAGLE draft model and what it is built from.

Modules: ``peagle_draft`` (the draft and its P-EAGLE mixins), ``build`` (building it with
speculators' builders, loading a trained one; the ``draft`` config section), ``target``
(the verifier as the draft needs it; the ``verifier`` section), ``mask_token`` (choosing
and checking the mask id), ``speculators_config`` (reading a saved draft's config.json),
``model_card`` (a saved draft's ``README.md``, written by train, eval and export).
"""
