"""runtime: running an mlx-lm MoE model whose routed experts live on disk.

Owns the expert cache, the cache-backed MoE module, model loading with experts
stripped, generation, budgets and the `specmoe` CLI. It never parses safetensors
itself: byte ranges come from `storage`.
"""
