"""The P-EAGLE algorithm itself: COD sampling, segments, the visibility rule, its knobs.

Modules: ``peagle_data`` (COD sampling, segment assignment), ``peagle_attention`` (the
visibility rule and its ``mask_mod``), ``peagle_config`` (the ``peagle`` section).

Shape letters, the same in every module of the package (a module's own local letters are
listed in its docstring):

- ``B`` batch rows, ``L`` tokens per packed row, ``N`` COD elements of a row (or of one
  segment of it), ``K`` depths, ``S`` segments;
- ``H`` target hidden size, ``D`` draft hidden size, ``A`` aux (captured target) layers;
- ``V`` target vocabulary, ``V_d`` draft vocabulary;
- ``nh`` / ``nkv`` attention / key-value heads, ``hd`` head dim.
"""
