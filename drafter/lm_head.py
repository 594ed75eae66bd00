"""The frozen LM head over many rows of drafter states, a chunk of rows at a time, so that the full
rows x vocabulary logits never exist at once: each row's most likely tokens and the chunk size that
bounds one chunk's fp32 logits."""
import torch


def chunk_rows_for(vocab_size: int, chunk_bytes: int = 256 * 2**20) -> int:
    return max(1, chunk_bytes // (4 * vocab_size))


@torch.no_grad()
def top_logprobs(hidden, head_weight, k: int, chunk_rows: int, labels=None):
    """(log-probabilities, token ids) [rows, k] of each row's k most likely tokens under the frozen
    LM head, `chunk_rows` rows of fp32 logits at a time; with `labels` [rows], also each label's
    log-probability [rows] (a third value)."""
    values = hidden.new_empty((hidden.shape[0], k), dtype=torch.float32)
    ids = torch.empty((hidden.shape[0], k), dtype=torch.long, device=hidden.device)
    label_values = None if labels is None else hidden.new_empty(labels.shape, dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        logits = (hidden[rows] @ head_weight.T).float()
        logprobs = logits - logits.logsumexp(-1, keepdim=True)
        values[rows], ids[rows] = logprobs.topk(k, dim=-1)
        if labels is not None:
            label_values[rows] = logprobs.gather(1, labels[rows, None])[:, 0]
    return (values, ids) if labels is None else (values, ids, label_values)
