"""The target side: the frozen target model and the features read off its own forward (model.py),
its own cache in decoding (cache.py) and its tensor-parallel sharding (tensor_parallel.py), and the
features' diagnostic calibrations (calibration.py). Where a target family needs code of its own, it
lives here, named for the family (tree_conv.py: LFM2's short conv over a tree)."""
