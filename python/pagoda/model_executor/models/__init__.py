"""Model families; `registry.get_model_class(hf_config)` picks one."""
