"""DeepSeek-V4.1 (``model_type: deepseek_v41``): the causal encoder-decoder text backbone."""
