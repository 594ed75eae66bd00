"""The draft vocabulary (drafter/models/draft_vocab.py): the table, training on its K rows of the
target head, a fresh drafter's final norm scaled by those rows, serving through it losslessly (on a
hybrid target's path-batch verify too), and its export."""
import copy
import json
from collections import Counter

import datasets
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import MASK_ID, VARIANTS, make_drafter, randomize_
from drafter.config import ObjectiveConfig, resolve_gamma
from drafter.pipeline.datasets import supervised_token_counts
from drafter.errors import ConfigError
from drafter.models import DFlashDraftModel, drafter_class, initial_norm_scale, load_drafter, new_drafter
from drafter.models.blocks import DraftingSetup, FeatureBatch, build_blocks, drafter_hidden, sample_anchors
from drafter.models.configure import drafter_config
from drafter.models.draft_vocab import DraftVocab, answer_vocab, commonest_tokens
from drafter.serving.decode import DecodeSettings, generate
from drafter.target_model.model import context_features, features_and_final_hidden, random_qwen3
from drafter.training.metrics import rank_metrics
from drafter.training.objective import training_step
from drafter.tree.ddtree import build_tree

B = 8
V = 256


def answers(rows: list[tuple[list[int], list[int]]]) -> datasets.Dataset:
    return datasets.Dataset.from_dict({"input_ids": [ids for ids, _ in rows], "loss_mask": [m for _, m in rows],
                                       "length": [len(ids) for ids, _ in rows]})


def with_draft_vocab(drafter, target_ids: torch.Tensor):
    """A copy of `drafter` whose head is the target's rows `target_ids`."""
    config = copy.deepcopy(drafter.config)
    config.draft_vocab_size = len(target_ids)
    cut = drafter_class(config)(config)
    missing, unexpected = cut.load_state_dict(drafter.state_dict(), strict=False)
    assert sorted(missing) == ["d2t", "t2d"] and not unexpected
    cut.set_draft_vocab(DraftVocab.of(target_ids, config.vocab_size))
    return cut.eval()


def batch(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 250, (len(lengths), max(lengths)), generator=gen)
    loss_mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        loss_mask[row, 3:n] = 1
    return ids, loss_mask


# ------------------------------------------------------------------------------------------ the table

def test_commonest_supervised_tokens_ties_by_id_unseen_last():
    data = answers([([7, 5, 5, 9, 2], [0, 1, 1, 1, 1]),  # the unsupervised 7 does not count
                    ([9, 5, 3, 7, 8], [1, 1, 1, 0, 0])])
    # counts: 5 x3, 9 x2, then 2 and 3 once each (ties: lower id first), then the unseen 0, 1, 4, ...
    assert commonest_tokens(supervised_token_counts([data], 12), 2).tolist() == [5, 9]
    assert commonest_tokens(supervised_token_counts([data], 12), 3).tolist() == [2, 5, 9]
    assert commonest_tokens(supervised_token_counts([data], 12), 5).tolist() == [0, 2, 3, 5, 9]
    shuffled = answers([([9, 5, 3, 7, 8], [1, 1, 1, 0, 0]), ([7, 5, 5, 9, 2], [0, 1, 1, 1, 1])])
    assert commonest_tokens(supervised_token_counts([shuffled], 12), 3).tolist() == [2, 5, 9]
    split = answers([([3, 3], [1, 1]), ([1, 1, 1, 1], [1, 1, 1, 1]), ([7, 5, 5, 9, 2], [0, 1, 1, 1, 1])]).select([2, 0])
    # the split's rows only
    assert supervised_token_counts([split], 12).tolist() == [0, 0, 1, 2, 0, 2, 0, 0, 0, 1, 0, 0]
    many = answers([(list(range(0, 300, 3)) * 2 + list(range(300)), [1] * 500)])  # multiples of 3 twice, all once
    expected = sorted({*range(0, 300, 3), *(i for i in range(75) if i % 3)})
    assert commonest_tokens(supervised_token_counts([many], 400), 150).tolist() == expected
    vocab, line = answer_vocab(supervised_token_counts([data], 12), 2)
    assert vocab.target_ids.tolist() == [5, 9] and "71.4% of the 7 supervised training tokens" in line
    with pytest.raises(ConfigError, match="draft_vocab_size=13"):
        commonest_tokens(supervised_token_counts([data], 12), 13)


def test_table_is_eagle3s_offsets_and_mask_and_maps_both_ways():
    vocab = DraftVocab.of(torch.tensor([1, 4, 5, 9]), 10)
    buffers = vocab.buffers()
    assert buffers["d2t"].tolist() == [1, 3, 3, 6]  # target id = draft id + d2t
    assert buffers["t2d"].nonzero()[:, 0].tolist() == [1, 4, 5, 9]
    back = DraftVocab.from_buffers(buffers["d2t"], buffers["t2d"])
    assert back.target_ids.tolist() == [1, 4, 5, 9]
    assert vocab.to_target(torch.tensor([[3, 0], [2, 1]])).tolist() == [[9, 1], [5, 4]]
    draft, inside = vocab.to_draft(torch.tensor([9, 0, 4, 5, 3, 1]))
    assert inside.tolist() == [True, False, True, True, False, True]
    assert draft[inside].tolist() == [3, 1, 2, 0]
    full = vocab.full_logits(torch.tensor([[0.5, -1.0, 2.0, 0.0]]))
    assert full[0, [1, 4, 5, 9]].tolist() == [0.5, -1.0, 2.0, 0.0]
    assert torch.isinf(full[0, [0, 2, 3, 6, 7, 8]]).all()


def test_config_refuses_a_draft_vocab_it_cannot_serve(target):
    for size, message in [(0, "draft_vocab_size=0 must be"), (V + 1, f"draft_vocab_size={V + 1} must be")]:
        with pytest.raises(ConfigError, match=message):
            drafter_config(target.config, num_layers=1, block_size=B, mask_token_id=MASK_ID, draft_vocab_size=size)
    with pytest.raises(ConfigError, match="arch=dflash2 drafts over the target's whole vocabulary"):
        drafter_config(target.config, num_layers=2, block_size=B, mask_token_id=MASK_ID,
                       variant=VARIANTS["dflash2"], draft_vocab_size=64)


def test_a_fresh_drafters_final_norm_is_scaled_by_the_draft_head_it_trains_through(target):
    """new_drafter with a table: the table is set, and the final norm is 1 / the RMS row norm of the
    K rows it trains and drafts through, not of the whole head's (here rows of a third the norm); the other
    weights are those of the same seed without a table."""
    config = drafter_config(target.config, num_layers=1, block_size=B, mask_token_id=MASK_ID, draft_vocab_size=16)
    words = torch.arange(0, 64, 4)
    head = target.lm_head.weight.detach().clone()
    head[words] *= 1 / 3
    drafter = new_drafter(config, head, seed=5, draft_vocab=DraftVocab.of(words, V))
    assert torch.equal(drafter.draft_vocab.target_ids, words)
    assert drafter.norm.weight.unique().tolist() == [pytest.approx(initial_norm_scale(head[words]))]
    assert initial_norm_scale(head[words]) > 2.5 * initial_norm_scale(head)
    whole = new_drafter(drafter_config(target.config, num_layers=1, block_size=B, mask_token_id=MASK_ID), head, seed=5)
    assert torch.equal(whole.norm.weight, torch.full_like(whole.norm.weight, initial_norm_scale(head)))
    assert torch.equal(whole.fc.weight, drafter.fc.weight)


# ------------------------------------------------------------------------------------------ training

@pytest.mark.parametrize("objective", [{}, {"labels": "target", "loss": "kl", "position_weights": "dpace"},
                                       {"loss": "expected_tree", "truncate": "first_failure"}])
def test_training_step_with_the_whole_vocabulary_as_table_is_the_full_heads(target, objective):
    drafter = make_drafter(target, num_layers=1)
    cut = with_draft_vocab(drafter, torch.arange(V))
    ids, loss_mask = batch([40, 33, 21], seed=8)
    features, final_hidden = features_and_final_hidden(target, ids, drafter.target_layer_ids)
    cfg = ObjectiveConfig(num_anchors=6, ddtree_budget=12, ddtree_blocks=5, **objective)
    results = []
    for model in (drafter, cut):
        loss, metrics = training_step(DraftingSetup(model, target, "dense"),
                                      FeatureBatch(ids, loss_mask, features, final_hidden), cfg,
                                      torch.Generator().manual_seed(9))
        loss.backward()
        results.append((loss.detach(), metrics, model.fc.weight.grad.clone()))
    (full_loss, full, full_grad), (cut_loss, metrics, cut_grad) = results
    assert torch.equal(full_loss, cut_loss)
    assert torch.equal(full_grad, cut_grad)
    assert metrics.pop("out_of_vocab")[0] == 0
    assert full.keys() == metrics.keys()
    for name in full:
        assert torch.equal(full[name], metrics[name]), name


def test_out_of_vocab_labels_are_misses_and_left_out_of_the_loss(target):
    """The loss is the CE over the draft words of the in-vocabulary labels only; acc and the ranks count
    every supervised slot, an out-of-vocabulary label as a miss. The table's first word (draft id 0)
    is the drafter's commonest pick, so a label taken for draft id 0 would often be a hit."""
    full = make_drafter(target, num_layers=1)
    ids, loss_mask = batch([40, 33, 21], seed=8)
    features = context_features(target, ids, full.target_layer_ids)
    cfg = ObjectiveConfig(num_anchors=6, ddtree_budget=12, ddtree_blocks=5)
    anchors, valid = sample_anchors(loss_mask, cfg.num_anchors, torch.Generator().manual_seed(9))
    blocks = build_blocks(ids, loss_mask, anchors, valid, B, MASK_ID, gamma=resolve_gamma(None, B))
    with torch.no_grad():
        hidden = drafter_hidden(full, target, features, blocks, "dense")
        favourite = int(full.head_logits(target, hidden).argmax(-1).flatten().mode().values)
    table = torch.tensor([favourite] + [i for i in range(favourite + 1, V) if i % 2 == 0])
    drafter = with_draft_vocab(full, table)
    with torch.no_grad():
        loss, metrics = training_step(DraftingSetup(drafter, target, "dense"), FeatureBatch(ids, loss_mask, features),
                                      cfg, torch.Generator().manual_seed(9))
    logits = (hidden @ target.get_output_embeddings().weight[table].T).float()  # [b, A, B, K]
    inside = torch.isin(blocks.labels, table)
    draft_labels = torch.where(inside, torch.searchsorted(table, blocks.labels), 0)
    supervised = blocks.weights > 0
    supervised[..., 0] = False
    assert 0.2 < (~inside[supervised]).float().mean() < 0.8
    assert (logits.argmax(-1) == 0)[~inside & supervised].float().mean() > 0.2
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 2), draft_labels.flatten(), reduction="none")
    weights = (blocks.weights * inside).flatten()
    torch.testing.assert_close(loss, (ce * weights).sum() / weights.sum())
    label_logit = logits.gather(-1, draft_labels[..., None])
    ranks = torch.where(inside, (logits > label_logit).sum(-1), torch.iinfo(torch.long).max)
    for name, value in rank_metrics(ranks, blocks).items():
        torch.testing.assert_close(metrics[name], value, msg=name)
    assert metrics["acc"][1] == supervised.sum()  # every supervised slot counts
    torch.testing.assert_close(metrics["out_of_vocab"],
                               torch.stack([(~inside & supervised).sum(), supervised.sum()]).float())


# ------------------------------------------------------------------------------------------ serving

@pytest.fixture(scope="module")
def cut_trained(trained):
    """The trained drafter with its head cut to the 64 commonest tokens of its training answers."""
    answer = torch.zeros_like(trained.sequences)
    answer[:, trained.prompts.shape[1]:] = 1
    counts = supervised_token_counts([answers(list(zip(trained.sequences.tolist(), answer.tolist())))], V)
    vocab, line = answer_vocab(counts, 64)
    assert line.startswith("draft vocabulary: the 64 commonest of the target's 256 tokens, ")
    return with_draft_vocab(trained.drafter, vocab.target_ids)


def test_drafts_are_the_full_logits_best_among_the_draft_words(trained, cut_trained):
    """The chain is the argmax and the tree the best-budget tree of the drafter's logits with every
    word outside the table at -inf, in target ids."""
    table = cut_trained.draft_vocab.target_ids
    sequence = trained.sequences[:2]
    features = context_features(trained.target, sequence, cut_trained.target_layer_ids)
    anchors = torch.tensor([[9, 20], [12, 30]])
    blocks = build_blocks(sequence, torch.ones_like(sequence), anchors, torch.ones_like(anchors, dtype=torch.bool),
                          B, MASK_ID, gamma=1.0)
    with torch.no_grad():
        hidden = drafter_hidden(cut_trained, trained.target, features, blocks, "dense")[:, :, 1:].flatten(0, 1)
        full = trained.drafter.head_logits(trained.target, hidden)
        masked = torch.full_like(full, -torch.inf)
        masked[..., table] = full[..., table]
        logits = cut_trained.head_logits(trained.target, hidden)
    assert logits.shape[-1] == 64
    assert (masked.argmax(-1) != full.argmax(-1)).any()  # the cut changes some picks
    assert torch.equal(cut_trained.chain_picks(hidden, logits, None), masked.argmax(-1))
    assert torch.equal(cut_trained.chain_top(hidden, logits, None, 3)[1], masked.topk(3, dim=-1).indices)
    tree, expected = cut_trained.block_trees(hidden, logits, None, 12), build_tree(masked, 12)
    assert torch.equal(tree.tokens, expected.tokens) and torch.equal(tree.parents, expected.parents)


@pytest.mark.parametrize("method, budget", [("dflash", None), ("ddtree", 8)])
def test_served_with_a_draft_vocab_is_lossless_and_accepts(trained, cut_trained, method, budget):
    for i in range(2):
        prompt = trained.prompts[i:i + 1]
        reference = generate(trained.target, prompt, 30).output_ids
        served = generate(trained.target, prompt, 30, drafter=cut_trained, settings=DecodeSettings(method, budget))
        assert served.output_ids == reference
        assert len(served.output_ids) / len(served.acceptance_lengths) > 2.0  # random drafts: about 1


@pytest.mark.parametrize("method,budget,sampling", [("dflash", None, "rejection"), ("ddtree", 2, "match")])
def test_sampled_tokens_with_a_draft_vocab_follow_the_target_distribution(method, budget, sampling):
    """At T = 1 with 2 of a 3-token target's words drafted (rejection sampling proposes the third with
    probability 0), the first 3 output tokens still have the target's joint distribution (chi-square,
    1e-3 level; tests/test_serving.py's check on the whole head), the drafts accepted often."""
    from test_serving import VOCAB, chi_square_bound, target_joint
    target = randomize_(random_qwen3(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     num_key_value_heads=1, head_dim=8, intermediate_size=16), seed=40, scale=0.4)
    config = drafter_config(target.config, num_layers=1, block_size=3, mask_token_id=VOCAB - 1,
                            target_layer_ids=[0], draft_vocab_size=2)
    drafter = randomize_(DFlashDraftModel(config), seed=41, scale=0.6).eval()
    drafter.set_draft_vocab(DraftVocab.of(torch.tensor([0, 1]), VOCAB))
    prompt = torch.tensor([[0, 1, 2, 1, 0]])
    expected = target_joint(target, prompt, 3)
    torch.manual_seed(0)
    runs, counts, first_step = 300, Counter(), []
    for _ in range(runs):
        result = generate(target, prompt, 3, drafter=drafter,
                          settings=DecodeSettings(method, budget, temperature=1.0, sampling=sampling))
        counts[tuple(result.output_ids)] += 1
        first_step.append(result.acceptance_lengths[0])
    assert sum(length > 1 for length in first_step) > runs / 4
    assert any(2 in output for output in counts)  # the word no draft proposes is still sampled
    cells = [c for c in sorted(expected, key=expected.get, reverse=True) if expected[c] * runs >= 5]
    observed = [counts[c] for c in cells] + [runs - sum(counts[c] for c in cells)]
    wanted = [expected[c] * runs for c in cells] + [runs * (1 - sum(expected[c] for c in cells))]
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, wanted) if e > 0)
    assert statistic < chi_square_bound(len(observed) - 1), (statistic, len(observed))


@pytest.mark.parametrize("method", ["ddtree", "dflash"])
def test_on_a_hybrid_target_the_draft_words_map_back_to_target_ids(method):
    """A Gated DeltaNet target (ddtree verifies a batch of the tree's paths there, drafter/serving/
    path_verify.py): the scheduled drafts of tests/test_path_verify.py, scored over a draft vocabulary's
    K words only. The drafter's own chain and tree map them back to target ids: the output is the
    target's greedy text and every step accepts as scheduled (a draft id taken for a target id would
    be rejected at once)."""
    from families import random_target
    from test_path_verify import BLOCK, NEW, PROMPT, SCHEDULE, scheduled
    target = random_target("qwen3_5_text")
    prompt = torch.randint(0, 250, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    expected = generate(target, prompt, NEW).output_ids
    schedule = scheduled(target, prompt, expected)
    tokens = set(prompt[0].tolist() + expected)
    words = torch.tensor(sorted(tokens | {(t + 1) % V for t in tokens}))  # the true tokens and their decoys
    assert len(words) < V and not torch.equal(words, torch.arange(len(words)))
    cut = with_draft_vocab(schedule.drafter, words)

    def draft_states(target, ctx_features, block_ids, cache, depth=None):
        hidden, proposal = schedule.draft_states(target, ctx_features, block_ids, cache, depth)
        return hidden, proposal[..., words]  # [.., K]: the head's logits over the draft words

    cut.draft_states = draft_states
    result = generate(target, prompt, NEW, drafter=cut, settings=DecodeSettings(method, 16))
    assert result.output_ids == expected
    # a chain takes slot 2's decoy, where the tree branches past it (the schedule's docstring)
    accepted = [a if method == "ddtree" or a in (0, 1, BLOCK - 1) else 1 for a in SCHEDULE]
    assert list(result.acceptance_lengths[:len(SCHEDULE)]) == [a + 1 for a in accepted]


# ------------------------------------------------------------------------------------------ export

def test_export_records_the_table_and_loads_it_back(cut_trained, tmp_path):
    cut_trained.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["draft_vocab_size"] == 64
    with safe_open(tmp_path / "model.safetensors", "pt") as stored:
        table = DraftVocab.from_buffers(stored.get_tensor("d2t"), stored.get_tensor("t2d"))
    assert torch.equal(table.target_ids, cut_trained.draft_vocab.target_ids)
    loaded = load_drafter(tmp_path)
    assert torch.equal(loaded.draft_vocab.target_ids, cut_trained.draft_vocab.target_ids)
    assert torch.equal(loaded.draft_vocab.in_vocab, cut_trained.draft_vocab.in_vocab)


def test_a_table_that_does_not_map_is_refused_at_load(cut_trained, tmp_path):
    cut_trained.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["d2t"] = -tensors["d2t"]  # the offsets' sign turned: target ids below the draft ids
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=f"{tmp_path}: the draft vocabulary table .* outside the target's"):
        load_drafter(tmp_path)


def test_a_full_head_export_has_no_table(trained, tmp_path):
    trained.drafter.save_pretrained(tmp_path)
    assert "draft_vocab_size" not in json.loads((tmp_path / "config.json").read_text())
    with safe_open(tmp_path / "model.safetensors", "pt") as stored:
        assert set(stored.keys()) == set(trained.drafter.state_dict())
        assert not {"d2t", "t2d"} & set(stored.keys())


# ------------------------------------------------------------------------------------------ train.py

@pytest.mark.slow
@pytest.mark.parametrize("engine, launcher", [("deepspeed", "deepspeed"), ("fsdp", "torchrun")])
def test_two_rank_run_trains_serves_and_exports_a_draft_vocab(tmp_path, engine, launcher):
    """train.py on two ranks with drafter.draft_vocab_size: the table is the commonest answer tokens of
    the training rows, the out-of-vocabulary share is logged, evaluation and generation run, the export
    loads with its table."""
    from runs import run_to_end, write_run

    cfg = write_run(tmp_path, max_steps=6, save_every=6, eval_every=6, generate_every=6)
    run_to_end(cfg, "drafter.draft_vocab_size=24", f"train.engine={engine}", launcher=launcher)  # 32 tokens in all
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert len(train) == 6 and all(0 < r["out_of_vocab"] < 0.5 for r in train)
    assert any(r["kind"] == "eval" for r in records) and any(r["kind"] == "generate" for r in records)
    exported = load_drafter(tmp_path / "run" / "checkpoints" / "latest" / "drafter")
    assert exported.config.draft_vocab_size == 24
    assert set(exported.draft_vocab.target_ids.tolist()) < set(range(32))  # answer tokens, none unseen


def test_eval_serves_a_draft_vocab_checkpoint_losslessly_and_will_not_compare_it_with_the_public_loop(tmp_path):
    from eval import ddtree_accept
    from tiny_tokenizer import save_tiny_tokenizer

    target_dir = save_tiny_tokenizer(tmp_path / "target")
    target = random_qwen3(vocab_size=384, seed=3)
    target.save_pretrained(target_dir)
    drafter = make_drafter(target, block_size=4, target_path=str(target_dir),
                           chat_template_kwargs={"enable_thinking": False})
    with_draft_vocab(drafter, torch.arange(0, 384, 3)).save_pretrained(tmp_path / "ckpt" / "drafter")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("What is the capital of France?",
                                                                          "def add(a, b):")))
    flags = ["--ckpt", str(tmp_path / "ckpt"), "--bench", str(prompts), "--budgets", "2,8",
             "--max-new-tokens", "10", "--out", str(tmp_path / "results.json")]
    methods = ddtree_accept.main(flags)["benchmarks"]["prompts"]["methods"]
    assert list(methods) == ["ar", "hf", "dflash", "ddtree@2", "ddtree@8"]
    assert all(summary["lossless"] == "yes" for summary in methods.values())
    with pytest.raises(ConfigError, match="--check-public: .* drafts over a draft vocabulary"):
        ddtree_accept.main(flags + ["--check-public", "1"])
