"""Benchmarks behind ``arbor bench``: each module runs Arbor and mlx-lm on the same weights in one
run and prints ratios (speed: prefill/decode per weight format; cache: many conversations
against ``arbor serve``; spec: speculative decoding; batch: concurrent clients; gguf: a
.gguf kept quantized vs as float16; hybrid, glm, gemma4: random checkpoints of the newer
families)."""
