"""The control plane on a real run: status, auth, stop, metrics, a frozen owner, Abort."""

from __future__ import annotations

import functools
import os
import signal
import threading
import time

import pytest
import torch

import zero_ray as zr
from zero_ray.cli import main as cli_main
from zero_ray.control.auth import Credentials, read_token_file
from zero_ray.control.client import ClientConfig, CoordinatorClient
from zero_ray.models import mlp, mse_loss
from zero_ray.testing import single_process

pytestmark = pytest.mark.usefixtures("ray_session")

MODEL = functools.partial(mlp, 8, 2)


def _batch(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randn(n, 8, generator=g)


def _client(trainer: zr.ZeroTrainer, credentials: Credentials | None = None) -> CoordinatorClient:
    creds = credentials or read_token_file(trainer.control_token_file)
    return CoordinatorClient(ClientConfig(address=trainer.control_address, credentials=creds, timeout_s=20))


def test_status_round_trip_and_cli_during_training(capsys: pytest.CaptureFixture[str]) -> None:
    with zr.ZeroTrainer(MODEL, mse_loss, config=zr.ZeroConfig(stage=2, world_size=2)) as trainer:
        assert oct(os.stat(trainer.control_token_file).st_mode & 0o777) == "0o600"
        loss = trainer.step(_batch(8))["loss"]
        with _client(trainer) as client:
            status = client.status()
        assert (status.world_size, status.stage, status.step) == (2, 2, 1)
        assert status.last_loss == pytest.approx(loss)
        assert [r.rank for r in status.ranks] == [0, 1] and all(r.healthy for r in status.ranks)
        assert all(r.memory["params"] > 0 for r in status.ranks)
        assert cli_main(["status", "--address", trainer.control_address, "--token-file",
                         trainer.control_token_file]) == 0
        out = capsys.readouterr().out
        assert "world size" in out.lower() and "stage" in out.lower()


def test_a_wrong_token_is_unauthenticated_and_changes_nothing() -> None:
    with zr.ZeroTrainer(MODEL, mse_loss, config=zr.ZeroConfig(stage=1, world_size=2)) as trainer:
        real = read_token_file(trainer.control_token_file)
        forged = Credentials(job_id=real.job_id, token="x" * 43)
        with _client(trainer, forged) as client:
            with pytest.raises(zr.errors.AuthError, match="UNAUTHENTICATED"):
                client.stop("not allowed")
        assert not trainer.stop_requested
        assert trainer.step(_batch(8))["step"] == 1


def test_stop_from_an_operator_ends_the_loop_and_metrics_stream_out() -> None:
    with zr.ZeroTrainer(MODEL, mse_loss, config=zr.ZeroConfig(stage=2, world_size=2)) as trainer:
        with _client(trainer) as client:
            events: list[zr.control.handlers.MetricsEvent] = []
            got = threading.Event()
            stream = client.metrics(timeout_s=60)

            def read() -> None:
                for event in stream:
                    events.append(event)
                    got.set()
                    return

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            deadline = time.monotonic() + 30
            while not got.is_set() and time.monotonic() < deadline:  # until the stream is open
                trainer.step(_batch(8))
                got.wait(0.2)
            stream.close()
            assert events and events[0].loss > 0
            # samples per second here (float batches); tokens for token batches or a counted loss
            assert events[0].tokens_per_second > 0 and events[0].values["items"] == 8
            assert client.stop("maintenance") == "stopping"
        with pytest.raises(zr.StopRequested, match="maintenance"):
            trainer.step(_batch(8))


@pytest.mark.timeout(180)
def test_abort_unblocks_a_rank_stuck_in_a_collective_and_the_next_steps_are_correct() -> None:
    opt = zr.SGD(lr=0.1, momentum=0.9)
    # collective_timeout_s far beyond the test's own timeout: only Abort can unblock rank 0
    cfg = zr.ZeroConfig(stage=2, world_size=2, collective_timeout_s=3600)
    good = [_batch(14, seed=s) for s in range(3)]
    ref, _ = single_process(MODEL, mse_loss, opt, good)
    with zr.ZeroTrainer(MODEL, _fails_on_six_samples, optimizer=opt, config=cfg) as trainer:
        with pytest.raises(zr.OwnerError, match="one rank failed") as info:
            trainer.step(_batch(13))  # rank 1 (6 samples) fails; rank 0 blocks in its reduce-scatter
        assert info.value.rank == 1
        assert trainer.state.value == "ready"  # aborted, re-formed, state intact
        for b in good:
            trainer.step(b)
        params = trainer.full_state_dict()
    assert max(float((params[n] - ref[n]).abs().max()) for n in ref) <= 1e-6


def _fails_on_six_samples(module: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    if batch[0].shape[0] == 6:
        raise RuntimeError("one rank failed")
    return mse_loss(module, batch)


@pytest.mark.timeout(180)
def test_a_frozen_owner_is_reported_within_the_health_timeout() -> None:
    cfg = zr.ZeroConfig(stage=2, world_size=2, health_interval_s=0.5, health_timeout_s=3.0)
    with zr.ZeroTrainer(MODEL, mse_loss, config=cfg) as trainer:
        trainer.step(_batch(8))
        pid = trainer._pool.nodes[1]["pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(zr.OwnerLostError, match=r"rank 1 on node .* stopped answering") as info:
                trainer.step(_batch(8))
            detected = time.monotonic() - start
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        print(f"frozen owner detected after {detected:.2f}s (health_timeout_s=3.0)")
        assert info.value.rank == 1
        assert detected < 3.0 + 5.0  # the stall timeout plus a heartbeat interval and scheduling slack
        assert trainer.state.value == "failed"


@pytest.fixture(scope="module")
def loopback_certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 acting as its own CA."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=zero-ray-test",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=60)
    return str(cert), str(key)


def test_mutual_tls_on_every_control_connection(loopback_certificate: tuple[str, str]) -> None:
    cert, key = loopback_certificate
    tls = zr.ControlTLS(cert=cert, key=key, ca=cert)
    with zr.ZeroTrainer(MODEL, mse_loss, config=zr.ZeroConfig(stage=2, world_size=2, control_tls=tls)) as trainer:
        assert trainer.step(_batch(8))["step"] == 1  # owners' servers and the driver's clients speak mTLS
        args = ["status", "--address", trainer.control_address, "--token-file", trainer.control_token_file]
        assert cli_main(args + ["--tls-ca", cert, "--tls-cert", cert, "--tls-key", key]) == 0
        assert cli_main(args) != 0  # plain text is refused


def _refuse_on_the_owner(*_: object) -> torch.Tensor:
    raise RuntimeError("this batch cannot be unpickled on an owner")


class _Unloadable(torch.Tensor):
    """A batch tensor that pickles on the driver and fails to unpickle where it lands."""

    def __reduce_ex__(self, protocol: object) -> tuple[object, tuple[()]]:
        return _refuse_on_the_owner, ()


@pytest.mark.timeout(180)
def test_a_failed_staging_call_fails_the_step_at_once_with_its_own_error() -> None:
    # collective_timeout_s (how long an owner waits for its staged piece) far beyond the test's
    # own timeout: only the staging call's failure, seen by the driver, can end the step.
    cfg = zr.ZeroConfig(stage=2, world_size=2, collective_timeout_s=3600)
    with zr.ZeroTrainer(MODEL, mse_loss, config=cfg) as trainer:
        x, y = _batch(8)
        start = time.monotonic()
        with pytest.raises(zr.ZeroRayError, match="cannot be unpickled on an owner") as info:
            trainer.step((x.as_subclass(_Unloadable), y))
        failed_after = time.monotonic() - start
        print(f"a failed staging call failed the step after {failed_after:.2f}s: {str(info.value).splitlines()[0]}")
        assert str(info.value).splitlines()[0].endswith("failed in stage_batch: RuntimeError: this batch cannot be "
                                                        "unpickled on an owner")
        assert failed_after < 60  # not the owner's 3600 s wait for a piece that never comes
        assert trainer.state.value == "ready"  # nothing was lost or updated: re-formed
        assert trainer.step(_batch(8))["step"] == 1
