"""The engine: scheduler -> runner -> drafter -> verify -> sample -> update; block manager, KV config,
sampler, detokenizer, stop strings, sampling defaults."""
