"""hmad's model store: models pulled from Hugging Face, listed, removed, and named as ``--model``.

    pull("ggml-org/gemma-3-4b-it-GGUF:Q4_K_M")      -> PullResult   (hub.py: the transfer)
    list_models()                                   -> [ModelEntry] (catalog.py: GGUF headers only)
    remove_model("owner/repo:Q4_K_M", loaded=...)   -> RemovedModel
    resolve_model_ref("hf:owner/repo:Q8_0")         -> (model path, projector path or None)

Where the store is: paths.py. The ``REPO[:QUANT]`` syntax and which GGUF a quant names: refs.py, select.py.
Every function returns plain dataclasses and raises ``errors.StoreError`` (a message for the user) so
that a daemon route can call it as the CLI does. Nothing is imported here: huggingface_hub (hub.py) is
imported only by what pulls, so the daemon's start with a local model does not pay for it.
"""
