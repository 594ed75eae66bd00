"""The target side: the frozen target model and the features read off its own forward (model.py),
its own cache in decoding (cache.py) and its tensor-parallel sharding (tensor_parallel.py). Where a target family needs code of its own, it
lives here, named for the family."""
