"""The model side of the engine: layers, model families, weight loading.

`model_loader.get_model(...)` builds a model; the model runner binds KV caches
to its Attention layers (`layers.attention.bind_kv_caches`) and calls it inside
`pagoda.forward_context.set_forward_context(...)`.
"""
