"""DeepSeek-V4 decoder pieces block drafters share (decoder.py: the block layer, its attention and window)."""
