"""Small helpers every layer shares.

Modules: ``devices`` (the device a user names, checked), ``dtypes`` (the dtype names users
type), ``errors`` (what a command reports as one sentence, and what as a bug), ``files``
(atomic writes), ``lock`` (one writer per output directory), ``paths`` (output paths checked
up front, free space, writes that run out of it), ``reading`` (reading the files users hand
in), ``settings`` (config sections whose fields are flags and YAML keys).
"""
