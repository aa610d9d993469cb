"""The draft's heavy operations: attention under the P-EAGLE mask on CPU and CUDA, and the
fused ``lm_head`` + KL loss (whose ``loss`` config section lives in ``fused_kl``).

Modules: ``attention`` (the path chosen per device), ``flex`` (compiled flex attention),
``cod_block_mask`` (its ``BlockMask``, from the COD layout), ``block_sparse`` (the exact CPU
path), ``fused_kl``, ``fused_ops``.
"""
