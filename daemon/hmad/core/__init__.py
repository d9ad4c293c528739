"""The nouns every floor of hmad shares, importing nothing else of hmad.

- ``batch``: ``StepBatch``, one engine step's tokens, positions and block tables;
- ``kv_layout``: ``KVLayout``, the shape of the backend's paged KV pools;
- ``model_config``: ``ModelConfig``, a model's hyper-parameters;
- ``qtypes``, ``quants``, ``tensors``: quant formats, their numpy decoders, ``WeightTensor``;
- ``errors``: the exception types users see.
"""
