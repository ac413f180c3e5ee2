"""Gemma 4 decoder pieces block drafters share (decoder.py: the layer, its attention and RoPE)."""
