"""bench/peer_speculators.py: speculators' own DFlash trainer on this repo's store, resumed in pieces to the
same losses as straight, and exported to dflash checked against the peer. Skipped where speculators 0.9.0
is not importable (CI; locally `make peer-env` and PYTHONPATH=.peer) or the real world's store and target are absent."""
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("speculators.train.trainer", exc_type=ImportError)

REPO = Path(__file__).resolve().parents[1]
STORE = REPO / "artifacts/features/smollm2_bf16_train_data"
DATA = REPO / "artifacts/smollm2/train_data"
CHECK = REPO / "artifacts/smollm2/bench_chat_data"
if not all(p.exists() for p in (STORE, DATA, CHECK, REPO / "artifacts/smollm2/target")):
    pytest.skip("the real world's store, data and target are not built here", allow_module_level=True)

sys.path.insert(0, str(REPO / "bench"))
import peer_speculators  # noqa: E402

# a tiny slice: 6 rows (~1,000 tokens) packed into 512-token rows, 3 steps an epoch, 16 anchors a step
TINY = ["--store", str(STORE), "--data", str(DATA), "--check-data", str(CHECK), "--rows", "6",
        "--tokens-per-step", "512", "--anchors-per-step", "16", "--steps", "4", "--save-every", "100"]


def losses_in(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("peer")
    cache = ["--verifier-cache", str(tmp / "verifier.safetensors")]
    straight = peer_speculators.main(TINY + cache + ["--out", str(tmp / "straight"), "--export", str(tmp / "export")])
    # pieces: 2 steps (mid-epoch), 1 (to the epoch's end), the rest (a new epoch): both RNG restore points;
    # step 2 exported between pieces, which must not change the run
    pieces = [peer_speculators.main(TINY + cache + ["--out", str(tmp / "pieces"), *extra]) for extra in
              (["--piece-steps", "2"], ["--resume", "--export-now", "--export", str(tmp / "export_2")],
               ["--resume", "--piece-steps", "1"], ["--resume"])]
    return tmp, straight, pieces


def test_resume_in_pieces_equals_straight(runs):
    tmp, straight, pieces = runs
    assert straight["step"] == 4 and len(straight["losses"]) == 4
    assert [p["start_step"] for p in pieces] == [0, 2, 2, 3] and pieces[-1]["step"] == 4
    assert sum((p["losses"] for p in pieces), []) == straight["losses"]  # bit for bit
    assert losses_in(tmp / "pieces") == losses_in(tmp / "straight") == straight["losses"]
    assert straight["losses"][-1] < straight["losses"][0]


def test_export_reproduces_the_peer(runs):
    tmp, straight, _ = runs
    check = straight["export_check"]
    assert check["anchors"] >= 8 and check["hidden"] < 1e-4 and check["serving_hidden"] < 1e-4
    config = json.loads((tmp / "export" / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention"] * 2 and config["sliding_window"] == 2048
    assert config["dflash_config"]["target_layer_ids"] == [1, 27] and config["dflash_config"]["mask_token_id"] == 3


def test_a_point_before_the_end_is_exported_without_training_on(runs):
    tmp, _, pieces = runs
    assert pieces[1]["step"] == 2 and pieces[1]["losses"] == [] and pieces[1]["export_check"]["hidden"] < 1e-4
    config = json.loads((tmp / "export_2" / "config.json").read_text())
    assert config["dflash_config"]["trained_by"]["step"] == 2
    with pytest.raises(SystemExit, match="give --resume and --export"):
        peer_speculators.main(TINY + ["--out", str(tmp / "pieces"), "--export-now"])
    with pytest.raises(SystemExit, match="holds no checkpoint to export"):
        peer_speculators.main(TINY + ["--out", str(tmp / "typo"), "--resume", "--export-now", "--export", str(tmp / "x")])
    assert not (tmp / "typo").exists() and not (tmp / "x").exists()


def test_a_miswired_export_is_refused(runs, monkeypatch, capsys):
    """The mutation: layer 0's k_proj and v_proj swapped in the weight mapping (same shapes)."""
    tmp, _, _ = runs
    right = peer_speculators.weight_mapping

    def swapped(num_layers):
        mapping = right(num_layers)
        k, v = "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight"
        mapping[k], mapping[v] = mapping[v], mapping[k]
        return mapping

    monkeypatch.setattr(peer_speculators, "weight_mapping", swapped)
    with pytest.raises(SystemExit, match="export check failed"):
        peer_speculators.main(TINY + ["--out", str(tmp / "straight"), "--resume", "--export", str(tmp / "bad")])
    assert not (tmp / "bad").exists() and not (tmp / "bad.tmp").exists()


def test_a_layout_dflash_cannot_express_is_refused():
    from transformers import Qwen3Config
    config = Qwen3Config(num_hidden_layers=2, layer_types=["sliding_attention"] * 2, sliding_window=2048,
                         use_sliding_window=True)
    assert peer_speculators.dflash_layout(config, False, 16, 2048) == (["sliding_attention"] * 2, 2048, None)
    with pytest.raises(peer_speculators.PeerError, match="export refused: the peer trained on packed rows of 4096"):
        peer_speculators.dflash_layout(config, False, 16, 4096)
    config.sliding_window = 8
    with pytest.raises(peer_speculators.PeerError, match="sliding window 8 < block size 16"):
        peer_speculators.dflash_layout(config, False, 16, 8)
