"""Image input at the front end: a chat request's ``image_url`` parts fetched (data URIs,
``file://`` under ``--allowed-local-media-path``, http(s) with a size cap and a timeout)
and checked before anything is decoded (``loading.py``); the parts counted, refused for a
text-only model, and turned into the chat template's image parts (``chat.py``). No torch:
pixels are the engine's (server/engine/multimodal)."""
