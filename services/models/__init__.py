"""Model files: fetch and convert known models (fetch.py, gguf_convert.py) and write tiny
random ones for tests (tiny.py). Each result is a Hugging Face directory (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json).
"""
