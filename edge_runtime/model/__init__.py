"""The model: GGUF file, config, loader, transformer (GQA), tokenizer, chat template, fused decode step."""
