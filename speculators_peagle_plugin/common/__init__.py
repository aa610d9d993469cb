"""Small helpers every layer shares.

Modules: ``devices`` (the device a user names, checked), ``dtypes`` (the dtype names users
type), ``files`` (atomic writes), ``lock`` (one writer per output directory), ``reading``
(reading the files users hand in), ``settings`` (config sections whose fields are flags and
YAML keys).
"""
