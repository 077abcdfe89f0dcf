"""Model building blocks in vLLM's shapes and names, sharded by the tensor-parallel rank.

Every parameter that comes from a checkpoint has a ``weight_loader(param, loaded, *shard)``
that copies this rank's slice of a full Hugging Face tensor into it.
"""
