"""The draft tree (ddtree.py): DDTree's best-first build from a block's per-depth distributions
(tree_heap.c, its heap compiled for the CPU), the selector's conditional tree for DFlash2, tree
visibility and the verification walk. Pure tensor algorithms: the models build trees, the losses and
metrics score them, serving verifies them."""
