/* Best-first DDTree construction (the reference algorithm), compiled for the CPU path of
 * drafter/tree/ddtree.py. `pip install` builds it as the extension module drafter.tree._tree_heap
 * (pyproject.toml's ext-modules); ddtree.py calls ddtree_best_first in it through ctypes.
 *
 * Scores are fixed-point summed log-probabilities (int64), so sums are exact and ties are real.
 * A heap entry is a prefix of top-k ranks (r_1..r_d); it pops before another when its score is
 * higher, or on a tie when its rank tuple is lexicographically smaller (a prefix first), which is
 * Python's tuple order in the reference's heap. Popping a node pushes its next sibling and its
 * first child; nodes are numbered in pop order, so a parent precedes its children.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int64_t score;  /* fixed-point log-probability of the whole prefix */
    int64_t base;   /* score of the parent prefix (0 for depth 1) */
    int32_t depth;  /* 1-based */
    int32_t rank;   /* rank of the last token among its depth's top-k */
    int32_t parent; /* pop index of the parent, -1 for the root's children */
    int32_t path;   /* slot of this entry's rank tuple in the path pool */
} Entry;

typedef struct {
    Entry *items;
    int64_t size;
    const int32_t *paths;
    int64_t max_depth;
} Heap;

static int pops_before(const Heap *h, const Entry *a, const Entry *b) {
    if (a->score != b->score) return a->score > b->score;
    const int32_t *pa = h->paths + (int64_t)a->path * h->max_depth;
    const int32_t *pb = h->paths + (int64_t)b->path * h->max_depth;
    int32_t shared = a->depth < b->depth ? a->depth : b->depth;
    for (int32_t i = 0; i < shared; i++)
        if (pa[i] != pb[i]) return pa[i] < pb[i];
    return a->depth < b->depth;
}

static void heap_push(Heap *h, Entry e) {
    int64_t i = h->size++;
    while (i > 0) {
        int64_t up = (i - 1) / 2;
        if (!pops_before(h, &e, &h->items[up])) break;
        h->items[i] = h->items[up];
        i = up;
    }
    h->items[i] = e;
}

static Entry heap_pop(Heap *h) {
    Entry top = h->items[0];
    Entry last = h->items[--h->size];
    int64_t i = 0;
    for (;;) {
        int64_t child = 2 * i + 1;
        if (child >= h->size) break;
        if (child + 1 < h->size && pops_before(h, &h->items[child + 1], &h->items[child])) child++;
        if (!pops_before(h, &h->items[child], &last)) break;
        h->items[i] = h->items[child];
        i = child;
    }
    if (h->size > 0) h->items[i] = last;
    return top;
}

/* scores: [batch, depth_limit, k] fixed-point log-probs, each row sorted descending.
 * Writes depth, rank and parent of each node in pop order to [batch, budget] outputs and returns
 * the node count (the same for every batch row), or -1 when out of memory. */
int64_t ddtree_best_first(const int64_t *scores, int64_t batch, int64_t depth_limit, int64_t k,
                          int64_t budget, int64_t *out_depth, int64_t *out_rank,
                          int64_t *out_parent) {
    if (budget <= 0 || depth_limit <= 0 || k <= 0) return 0;
    int64_t capacity = 2 * budget + 1;
    Entry *items = malloc(capacity * sizeof(Entry));
    int32_t *paths = malloc(capacity * depth_limit * sizeof(int32_t));
    if (items == NULL || paths == NULL) {
        free(items);
        free(paths);
        return -1;
    }
    int64_t count = 0;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t *lp = scores + b * depth_limit * k;
        Heap h = {items, 0, paths, depth_limit};
        int32_t slots = 0;
        paths[0] = 0;
        heap_push(&h, (Entry){lp[0], 0, 1, 0, -1, slots++});
        count = 0;
        while (h.size > 0 && count < budget) {
            Entry e = heap_pop(&h);
            int64_t me = count++;
            out_depth[b * budget + me] = e.depth;
            out_rank[b * budget + me] = e.rank;
            out_parent[b * budget + me] = e.parent;
            const int32_t *path = paths + (int64_t)e.path * depth_limit;
            if (e.rank + 1 < k) {
                int32_t *sibling = paths + (int64_t)slots * depth_limit;
                memcpy(sibling, path, e.depth * sizeof(int32_t));
                sibling[e.depth - 1] = e.rank + 1;
                int64_t score = e.base + lp[(e.depth - 1) * k + e.rank + 1];
                heap_push(&h, (Entry){score, e.base, e.depth, e.rank + 1, e.parent, slots++});
            }
            if (e.depth < depth_limit) {
                int32_t *child = paths + (int64_t)slots * depth_limit;
                memcpy(child, path, e.depth * sizeof(int32_t));
                child[e.depth] = 0;
                int64_t score = e.score + lp[e.depth * k];
                heap_push(&h, (Entry){score, e.score, e.depth + 1, 0, (int32_t)me, slots++});
            }
        }
    }
    free(items);
    free(paths);
    return count;
}

/* An importable module with no Python functions: importing it locates the built library. */
static struct PyModuleDef tree_heap_module = {PyModuleDef_HEAD_INIT, "_tree_heap",
                                              "ddtree_best_first, called through ctypes", -1, NULL};

PyMODINIT_FUNC PyInit__tree_heap(void) { return PyModule_Create(&tree_heap_module); }
