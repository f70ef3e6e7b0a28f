"""DeepSeek-V4: config, parameter inventory, model over the paged hybrid cache, tiny checkpoints."""
