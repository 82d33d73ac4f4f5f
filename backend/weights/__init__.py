"""Weights on disk and their way into a model: everything between a file and an ``nn.Module``.

* ``files``: a model folder read without loading tensors (config, shards, safetensors headers);
* ``quantize``: MLX affine quantization and the config's ``quantization`` block;
* ``gguf`` / ``gguf_quants`` / ``gguf_layouts`` / ``gguf_tokenizer``: a llama.cpp GGUF file -> an
  Arbor (Hugging Face) model folder (the file; its tensor types as MLX affine codes; each
  architecture's names, config and value changes; its vocabulary);
* ``store``: the local model store (imports, pairing, the default model);
* ``loading``: a model folder -> a ``LoadedModel`` (checked weights, compute dtype, CPU path).

This package depends on ``backend.models`` (the architecture registry and layers) and never the
other way round: architectures know nothing of files.
"""
