"""dtype auto on a CPU: bf16 where the probe (drafter/infra/cpu_dtype.py) finds it faster than fp32, else
fp32; an explicit bf16 where it is slow is warned about once; the probe runs once per process, and in a
group of ranks rank 0's verdict is every rank's. conftest.py sets DRAFTER_CPU_BF16=slow for the other
tests; these set or unset it themselves."""
import subprocess
import sys
import textwrap

import pytest
import torch

from drafter.errors import ConfigError
from drafter.infra import cpu_dtype
from drafter.target_model.model import compute_dtype
from runs import REPO, _env, free_port

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a cuda device object needs no GPU


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """No verdict cached and nothing said yet, before and after each test."""
    cpu_dtype.probed.cache_clear()
    monkeypatch.setattr(cpu_dtype, "_said", set())
    yield
    cpu_dtype.probed.cache_clear()


def measured(monkeypatch, ratio: float) -> list[int]:
    """The probe measures `ratio` (bf16's time over fp32's); the list counts its runs."""
    calls = []
    monkeypatch.delenv("DRAFTER_CPU_BF16", raising=False)
    monkeypatch.setattr(cpu_dtype, "measure_ratio", lambda: calls.append(1) or ratio)
    return calls


@pytest.mark.parametrize("verdict, dtype", [("fast", torch.bfloat16), ("slow", torch.float32),
                                            ("FAST", torch.bfloat16)])
def test_the_override_decides_auto_on_the_cpu_and_cuda_stays_bf16(verdict, dtype, monkeypatch, capsys):
    monkeypatch.setenv("DRAFTER_CPU_BF16", verdict)
    monkeypatch.setattr(cpu_dtype, "measure_ratio", lambda: pytest.fail("the override runs no probe"))
    assert compute_dtype("auto", CPU) == dtype
    assert compute_dtype("auto", "cpu") == dtype
    assert compute_dtype("auto", CUDA) == torch.bfloat16
    assert compute_dtype("auto", torch.device("meta")) == torch.float32  # neither: fp32, as before
    assert compute_dtype("fp32", CPU) == torch.float32 and compute_dtype("float32", CUDA) == torch.float32
    assert "dtype auto" not in capsys.readouterr().err  # the user chose it: nothing measured to say


def test_a_bad_override_is_one_line():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DRAFTER_CPU_BF16", "maybe")
        with pytest.raises(ConfigError, match="DRAFTER_CPU_BF16=maybe: use fast or slow"):
            compute_dtype("auto", CPU)


@pytest.mark.parametrize("ratio, dtype, said", [
    (1 / 2.1, torch.bfloat16, "dtype auto: bf16: this CPU ({cap}) ran a 512x512 matmul 2.1x faster in bf16 than fp32"),
    (41.0, torch.float32, "dtype auto: fp32: this CPU ({cap}) ran a 512x512 matmul 41x slower in bf16 than fp32"),
    (1 / 1.1, torch.float32, "dtype auto: fp32: this CPU ({cap}) ran a 512x512 matmul only 1.1x faster in bf16 "
                             "than fp32, under the 1.2x bf16 needs"),
    (1 / 1.3, torch.bfloat16, "1.3x faster"),
])
def test_auto_on_the_cpu_is_what_the_probe_measured_said_once(ratio, dtype, said, monkeypatch, capsys):
    calls = measured(monkeypatch, ratio)
    assert compute_dtype("auto", CPU) == dtype
    assert compute_dtype("auto", CPU) == dtype
    assert compute_dtype("auto", CUDA) == torch.bfloat16
    err = capsys.readouterr().err
    assert said.format(cap=torch.backends.cpu.get_cpu_capability()) in err
    assert err.count("dtype auto") == 1 and calls == [1]


def test_the_threshold_is_bf16_at_least_1_2x_faster():
    assert cpu_dtype.verdict(1 / 1.25, "AVX512", 2).fast
    assert not cpu_dtype.verdict(1 / 1.15, "AVX512", 2).fast
    assert not cpu_dtype.verdict(1.0, "AVX2", 2).fast
    slow = cpu_dtype.verdict(55.0, "AVX2", 1)
    assert (slow.fast, slow.ratio, slow.capability) == (False, 55.0, "AVX2")
    assert slow.reason == "fp32: this CPU (AVX2) ran a 512x512 matmul 55x slower in bf16 than fp32 (1 thread)"


@pytest.mark.parametrize("name", ["bf16", "bfloat16"])
def test_an_explicit_bf16_where_it_is_slow_is_warned_once_and_kept(name, monkeypatch, capsys):
    measured(monkeypatch, 41.0)
    assert compute_dtype(name, CPU) == torch.bfloat16
    assert compute_dtype(name, CPU) == torch.bfloat16
    err = capsys.readouterr().err
    cap = torch.backends.cpu.get_cpu_capability()
    assert err.count("warning") == 1
    assert (f"warning: dtype {name} on this CPU ({cap}): bf16 matmuls ran 41x slower than fp32 here; dtype auto "
            "would pick fp32") in err
    monkeypatch.setenv("DRAFTER_CPU_BF16", "slow")
    monkeypatch.setattr(cpu_dtype, "_said", set())
    assert compute_dtype(name, CPU) == torch.bfloat16
    assert "DRAFTER_CPU_BF16=slow says bf16 is slow here; dtype auto would pick fp32" in capsys.readouterr().err


def test_no_warning_where_bf16_is_fast_on_a_gpu_or_for_fp32(monkeypatch, capsys):
    measured(monkeypatch, 0.5)
    assert compute_dtype("bf16", CPU) == torch.bfloat16
    monkeypatch.setenv("DRAFTER_CPU_BF16", "fast")
    assert compute_dtype("bf16", CPU) == torch.bfloat16
    monkeypatch.setenv("DRAFTER_CPU_BF16", "slow")
    assert compute_dtype("bf16", CUDA) == torch.bfloat16
    assert compute_dtype("fp32", CPU) == torch.float32
    assert "warning" not in capsys.readouterr().err


def test_the_probe_measures_once_leaves_the_rng_and_names_the_capability(monkeypatch):
    monkeypatch.delenv("DRAFTER_CPU_BF16", raising=False)
    calls, measure = [], cpu_dtype.measure_ratio
    monkeypatch.setattr(cpu_dtype, "measure_ratio", lambda: calls.append(1) or measure())
    rng = torch.get_rng_state()
    speed = cpu_dtype.bf16_speed()
    assert torch.equal(torch.get_rng_state(), rng)  # a run draws the same numbers with the probe as without
    assert isinstance(speed, cpu_dtype.Bf16Speed) and speed.ratio > 0
    assert speed.capability == torch.backends.cpu.get_cpu_capability()
    assert f"this CPU ({speed.capability}) ran a 512x512 matmul" in speed.reason
    assert speed.reason.startswith("bf16: " if speed.fast else "fp32: ")
    assert cpu_dtype.bf16_speed() is speed and calls == [1]
    with pytest.raises(AttributeError):
        speed.fast = not speed.fast  # frozen


RANKS = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from drafter.infra import cpu_dtype  # compute_dtype's part, without transformers' slow import
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method="tcp://127.0.0.1:" + sys.argv[2])
    cpu_dtype.measure_ratio = lambda: 0.25 if rank == 0 else 40.0  # rank 1 alone would pick fp32
    for _ in range(2):
        speed = cpu_dtype.bf16_speed()
        cpu_dtype.say_once(f"dtype auto: {speed.reason}")
    print(speed.fast, speed.ratio)
    dist.destroy_process_group()
""")


def test_every_rank_takes_rank_0s_verdict_said_by_rank_0_alone():
    env = _env()
    env.pop("DRAFTER_CPU_BF16", None)
    port = str(free_port())
    ranks = [subprocess.Popen([sys.executable, "-c", RANKS, str(rank), port], cwd=REPO, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in (0, 1)]
    outs = [rank.communicate(timeout=120) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outs
    assert [out for out, _ in outs] == ["True 0.25\n"] * 2
    assert outs[0][1].count("dtype auto: bf16:") == 1 and "dtype auto" not in outs[1][1]
