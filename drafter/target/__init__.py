"""The target side: the frozen target model and the features read off its own forward (model.py),
its own cache in decoding (cache.py), its tensor-parallel sharding (tensor_parallel.py) and the mask
token chosen from its tokenizer (mask_token.py). Where a target family needs code of its own, it
lives here, named for the family."""
