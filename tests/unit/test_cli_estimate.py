"""`zero-ray estimate`, through zero_ray.cli.main and `python -m zero_ray.cli`."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests_paths import REPO_ROOT
from zero_ray.cli import main


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of `zero-ray estimate ARGV`; argparse errors exit via
    SystemExit, run-time ones return 2, and both count as the status here."""
    try:
        status = main(["estimate", *argv])
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _stage_rows(out: str) -> dict[int, list[str]]:
    """Stage number -> cells of its row, for a single-block output."""
    rows = {}
    for line in out.splitlines():
        match = re.match(r"([0-3]) \S+\s", line)
        if match:
            rows[int(match[1])] = line.split()
    return rows


def test_table1_row_for_7_5b_on_64(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = _run(capsys, "--params", "7.5e9", "--world-size", "64")
    assert status == 0 and err == ""
    rows = _stage_rows(out)
    assert sorted(rows) == [0, 1, 2, 3]
    # Table 1 / the worked example: 120, 31.4, 16.6, 1.88 GB.
    for stage, gb in {0: "120.00", 1: "31.41", 2: "16.64", 3: "1.88"}.items():
        assert gb in rows[stage], (stage, rows[stage])
    for stage, reduction in {0: "1.00x", 1: "3.82x", 2: "7.21x", 3: "64.00x"}.items():
        assert reduction in rows[stage]
    # GiB column: 120e9 / 2**30.
    assert "111.76" in rows[0]
    # Communication: volume 2Ψ / 3Ψ and the ring's (63/64) share of it.
    assert "1.969" in " ".join(rows[0]) and "2.953" in " ".join(rows[3])
    assert "(1.969 Psi)" in out and "(2.953 Psi)" in out
    assert "K = 12" in out and "mixed precision" in out


def test_one_block_per_world_size(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _run(capsys, "--params", "1e12", "--world-size", "4", "1024")
    assert status == 0
    assert "Nd = 4" in out and "Nd = 1024" in out
    block4, block1024 = out.split("Nd = 1024")
    # Table 1, 1T: Nd=4 -> 7000 / 5500 / 4000; Nd=1024 stage 3 -> 15.6.
    for gb in ("7000.00", "5500.00", "4000.00"):
        assert gb in block4
    assert "15.62" in block1024 or "15.63" in block1024


def test_device_memory_adds_largest_model_table2(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _run(capsys, "--params", "7.5e9", "--world-size", "64",
                          "--device-memory-gb", "32")
    assert status == 0
    rows = _stage_rows(out)
    for stage, largest in {0: "2.00B", 1: "7.64B", 2: "14.42B", 3: "128.00B"}.items():
        assert rows[stage][-1] == largest


def test_fp32_sgd_without_momentum(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _run(capsys, "--params", "1000", "--world-size", "4", "--precision", "fp32",
                          "--optimizer", "sgd", "--no-momentum")
    assert status == 0
    assert "K = 0" in out and "8 B per parameter" in out


def test_torch_optimizers_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    # fp32 Adagrad: 4 + 4 + K = 4 (its sum) = 12 B per parameter; 1e9 of them on 4 devices.
    status, out, _ = _run(capsys, "--params", "1e9", "--world-size", "4", "--precision", "fp32",
                          "--optimizer", "adagrad")
    assert status == 0
    assert "K = 4 B optimizer state (sum (the parameter is the master copy))" in out and "torch.optim.Adagrad" in out
    rows = _stage_rows(out)
    for stage, gb in {0: "12.00", 1: "9.00", 2: "6.00", 3: "3.00"}.items():
        assert rows[stage][3] == gb, (stage, rows[stage])
    status, out, _ = _run(capsys, "--params", "1e9", "--world-size", "4", "--optimizer", "rmsprop-centered")
    assert status == 0 and "K = 12 B optimizer state (fp32 master + square_avg + grad_avg)" in out
    assert _stage_rows(out)[0][3] == "16.00"  # 2 + 2 + 12


@pytest.mark.parametrize(("optimizer", "precision", "k", "needle"), [
    ("adafactor", "fp32", 0, "4 (R + C) B per R x C matrix"),
    ("adafactor", "mixed", 4, "4 B per element of 1-D parameters"),
    ("muon", "fp32", 4, "Muon updates 2-D parameters only"),
])
def test_what_k_leaves_out_is_said(capsys: pytest.CaptureFixture[str], optimizer: str, precision: str, k: int,
                                   needle: str) -> None:
    status, out, _ = _run(capsys, "--params", "1e9", "--world-size", "8", "--optimizer", optimizer,
                          "--precision", precision)
    assert status == 0 and f"K = {k} B" in out and needle in out


def test_help_lists_every_optimizer(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _run(capsys, "--help")
    assert status == 0
    assert all(name in " ".join(out.split()) for name in ("adafactor", "rmsprop-centered-momentum", "adamw-amsgrad",
                                                          "rprop", "asgd", "muon", "nadam", "radam", "adamax"))


@pytest.mark.parametrize(("argv", "needle"), [
    (["--params", "1e9", "--world-size", "4", "--optimizer", "rmsprop", "--no-momentum"], "'rmsprop'"),
    (["--params", "abc", "--world-size", "4"], "'abc'"),
    (["--params", "-1", "--world-size", "4"], "'-1'"),
    (["--params", "0", "--world-size", "4"], "'0'"),
    (["--params", "10.5", "--world-size", "4"], "'10.5'"),
    (["--params", "nan", "--world-size", "4"], "'nan'"),
    (["--params", "1e9", "--world-size", "0"], "'0'"),
    (["--params", "1e9", "--world-size", "4", "x"], "'x'"),
    (["--params", "1e9", "--world-size", "4", "--precision", "bf16"], "'bf16'"),
    (["--params", "1e9", "--world-size", "4", "--optimizer", "lamb"], "'lamb'"),
    (["--params", "1e9", "--world-size", "4", "--device-memory-gb", "-3"], "'-3'"),
    (["--params", "1e9", "--world-size", "4", "--no-momentum"], "'adamw'"),
    (["--world-size", "4"], "--params"),
    (["--params", "1e12", "--world-size", "100", "--tensor-parallel", "16"], "--world-size 100 is not divisible by "
                                                                             "--tensor-parallel 16"),
    (["--params", "1e12", "--world-size", "64", "128", "--tensor-parallel", "1", "3"], "--tensor-parallel 3"),
    (["--params", "1e12", "--world-size", "64", "--tensor-parallel", "0"], "'0'"),
    (["--params", "1e12", "--world-size", "64", "--data-parallel", "64"], "not allowed with"),
    (["--params", "1e12", "--world-size", "64", "--tensor-parallel", "2", "--shard-group", "8"], "--shard-group"),
])
def test_bad_input_exits_2_with_message(capsys: pytest.CaptureFixture[str], argv: list[str],
                                        needle: str) -> None:
    status, out, err = _run(capsys, *argv)
    assert status == 2
    assert out == ""
    assert "error:" in err and needle in err, err
    assert "Traceback" not in err


def test_python_dash_m() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "zero_ray.cli", "estimate", "--params", "7.5e9", "--world-size", "64"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert "31.41" in result.stdout

    bad = subprocess.run(
        [sys.executable, "-m", "zero_ray.cli", "estimate", "--params", "7.5e9", "--world-size", "-2"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2 and "'-2'" in bad.stderr and "Traceback" not in bad.stderr


def test_offload_puts_each_category_on_its_tier(capsys: pytest.CaptureFixture[str]) -> None:
    # 7.5B mixed-precision Adam on 64 devices: 2 + 2 + 12 bytes per parameter, / 64 where partitioned.
    status, out, err = _run(capsys, "--params", "7.5e9", "--world-size", "64", "--offload-optimizer", "cpu")
    assert status == 0 and err == ""
    block = out[out.index("Offload at Nd = 64"):]
    rows = {int(line[0]): line.split()[2:] for line in block.splitlines() if re.match(r"[0-3] ", line)}
    assert rows == {0: ["30.00", "90.00", "0.00"], 1: ["30.00", "1.41", "0.00"], 2: ["15.23", "1.41", "0.00"],
                    3: ["0.47", "1.41", "0.00"]}
    status, out, _ = _run(capsys, "--params", "7.5e9", "--world-size", "64", "--offload-optimizer", "nvme",
                          "--offload-params", "nvme")
    block = out[out.index("Offload at Nd = 64"):]
    assert [line.split()[2:] for line in block.splitlines() if re.match(r"[0-3] ", line)] == [
        ["0.00", "0.00", "1.88"]]  # stage 3 only; the gradient partition goes with the parameters
    assert "stage 3 only" in block


# What `--data-parallel 64 --tensor-parallel 1 2 4 8 16 --device-memory-gb 32` prints per N_m (N_d x N_m owners),
# and the paper's Table 2 cells (baseline, P_os, P_os+g, P_os+g+p), in billions of parameters.
_TABLE2_PRINTED = {
    1: (["2.00B", "7.64B", "14.42B", "128.00B"], [2, 7.6, 14.4, 128]),
    2: (["4.00B", "15.28B", "28.85B", "256.00B"], [4, 15.2, 28.8, 256]),
    4: (["8.00B", "30.57B", "57.69B", "512.00B"], [8, 30.4, 57.6, 500]),
    8: (["16.00B", "61.13B", "115.38B", "1.02T"], [16, 60.8, 115.2, 1000]),
    16: (["32.00B", "122.27B", "230.76B", "2.05T"], [32, 121.6, 230.4, 2000]),
}


def test_tensor_parallel_reproduces_table2_mp_rows(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = _run(capsys, "--params", "1e12", "--data-parallel", "64", "--tensor-parallel", "1", "2", "4",
                            "8", "16", "--device-memory-gb", "32")
    assert status == 0 and err == ""
    table = out[out.index("Largest model whose model states fit 32 GB"):].splitlines()[3:]
    rows = {int(line.split()[0]): line.split() for line in table if line.strip()}
    assert sorted(rows) == [1, 2, 4, 8, 16]
    for nm, (printed, paper) in _TABLE2_PRINTED.items():
        assert rows[nm][:3] == [str(nm), str(64 * nm), "64"]
        assert rows[nm][3:] == printed, nm
        # Within the paper's rounding (it prints 7.6B x N_m; 0.5T, 1T, 2T to one digit).
        ours = [float(c[:-1]) * (1000 if c.endswith("T") else 1) for c in printed]
        assert ours == pytest.approx(paper, rel=0.05)
    # Each N_m block's "max Psi" column is that row too.
    block16 = out[out.index("Nd = 64 x Nm = 16"):out.index("Largest model")]
    assert [r[-1] for r in _stage_rows(block16).values()] == _TABLE2_PRINTED[16][0]


def test_1t_on_1024_devices_mp16_by_dp64(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = _run(capsys, "--params", "1e12", "--world-size", "1024", "--tensor-parallel", "16")
    assert status == 0 and err == ""
    assert "Nd = 64 x Nm = 16 (1024 owners: each model-parallel rank holds 1/16 of Psi, 62.50B" in out
    rows = _stage_rows(out)
    assert [rows[s][3] for s in range(4)] == ["1000.00", "261.72", "138.67", "15.62"]  # the paper's 16 GB
    # ZeRO-DP's volume over the slice, ring over N_d = 64; MP's own traffic is said to be left out.
    assert rows[0][-5:-3] == ["2", "Psi/Nm"] and "(0.123 Psi)" in " ".join(rows[0])
    assert rows[3][-5:-3] == ["3", "Psi/Nm"] and "(0.185 Psi)" in " ".join(rows[3])
    assert "no closed form" in out
    assert "Largest model" not in out  # only with --device-memory-gb


def test_tensor_parallel_one_changes_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("--params", "7.5e9", "--world-size", "64", "4", "--offload-optimizer", "cpu")
    _, plain, _ = _run(capsys, *argv)
    status, with_one, _ = _run(capsys, *argv, "--tensor-parallel", "1")
    assert status == 0 and with_one == plain
    _, data_parallel, _ = _run(capsys, "--params", "7.5e9", "--data-parallel", "64", "4", "--offload-optimizer", "cpu")
    assert data_parallel == plain


def test_world_size_and_tensor_parallel_give_one_block_each(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _run(capsys, "--params", "1e12", "--world-size", "64", "128", "--tensor-parallel", "1", "2",
                          "--offload-optimizer", "cpu")
    assert status == 0
    headers = [line.split(", ", 1)[1].split(" (")[0] for line in out.splitlines() if line.startswith("Psi = ")]
    assert headers == ["Nd = 64", "Nd = 32 x Nm = 2", "Nd = 128", "Nd = 64 x Nm = 2"]
    # The offload table of 1T at Nd = 64 x Nm = 2: the optimizer state (12 B of the 1/2 slice, / 64) on the host.
    block = out[out.index("Offload at Nd = 64 x Nm = 2"):]
    stage3 = next(line for line in block.splitlines() if line.startswith("3 "))
    assert stage3.split()[2:] == ["31.25", "93.75", "0.00"]


@pytest.mark.parametrize("argv", [
    ("--params", "1e12", "--data-parallel", "64", "--tensor-parallel", "1", "2", "4", "8", "16",
     "--device-memory-gb", "32"),
    ("--params", "1e12", "--world-size", "1024", "--tensor-parallel", "16"),
])
def test_docs_paste_what_the_command_prints(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...]) -> None:
    # docs/multinode.md pastes these outputs' last table; keep it current.
    with open(os.path.join(REPO_ROOT, "docs", "multinode.md"), encoding="utf-8") as f:
        blocks = f.read().split("```")[1::2]
    status, out, _ = _run(capsys, *argv)
    assert status == 0
    tail = out.rstrip("\n").split("\n\n")[-1]
    assert any(block.strip("\n") == tail for block in blocks), tail
