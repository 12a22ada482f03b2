"""Tiny random-init model configs (Llama, Gemma2, LFM2) written to a directory, for the vLLM
and SGLang tests and examples."""
