"""``ZeroTrainer.fit``: training over a dataset that every owner holds or reads itself.

A map-style dataset (or a factory for it) goes to every owner once; a ``zero_ray.data`` source
is scanned here (metadata only) and every owner opens it itself. Each step sends each owner its
indices only (``core/data_order.EpochOrder``, or ``BlockOrder`` for a source, fixes which) and the
owner builds its piece. The driver holds indices, never samples, so a replay after a lost owner,
a resize or a resume from a checkpoint reads exactly the same samples. A checkpoint records the
order's parameters and the source's identity so that ``fit`` after ``from_checkpoint``
continues at the right epoch and offset of the same data, or says what changed.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import ray

from zero_ray.core.data_order import BlockOrder, EpochOrder, evaluation_chunks
from zero_ray.data import as_source, opener
from zero_ray.driver.batch_staging import IndexedBatch
from zero_ray.driver.stepper import Stepper
from zero_ray.driver.reports import StepMetrics
from zero_ray.errors import ConfigError


log = logging.getLogger(__name__)

TRAIN, EVAL = "train", "eval"


class RunExtras:
    """What a checkpoint of the run records beside the model state (``saved``: fit's data order,
    under ``"fit"``), and what the checkpoint the run last loaded recorded (``resumed``), which
    the next fit checks against its own and then drops."""

    def __init__(self) -> None:
        self.saved: dict[str, Any] = {}
        self.resumed: dict[str, Any] = {}

    def loaded(self, extra: dict[str, Any]) -> None:
        """A checkpoint was loaded: its records replace the run's."""
        self.saved, self.resumed = dict(extra), dict(extra)

    def begin_fit(self, record: dict[str, Any]) -> None:
        """A fit reading data in the order ``record`` describes starts: refused if the loaded
        checkpoint's fit read other data or another order, else what checkpoints record now."""
        saved = self.resumed.get("fit")
        if saved is not None and saved != record:  # kept for the next fit to check: this one changes nothing
            raise ConfigError(f"the checkpoint this run resumed from was saved by a fit over other data or in another "
                              f"order ({'; '.join(changes(saved, record))}): it would not continue the same samples; "
                              "pass the same data, global_batch_size and seed")
        self.resumed.pop("fit", None)
        self.saved["fit"] = record


@dataclass(frozen=True, kw_only=True)
class FitRun:
    """What a fit works through, all of it the trainer's."""

    stepper: Stepper
    extras: RunExtras
    checkpoint_dir: str | os.PathLike[str] | None  # config.checkpoint.dir: where checkpoint_every saves
    save_checkpoint: Callable[[], str]  # a checkpoint under checkpoint_dir (not waited for); its directory


@dataclass(frozen=True, kw_only=True)
class FitPlan:
    """A fit's arguments, checked."""

    global_batch_size: int
    steps: int
    seed: int = 0
    eval_every: int | None = None
    checkpoint_every: int | None = None

    def __post_init__(self) -> None:
        for name in ("global_batch_size", "steps", "eval_every", "checkpoint_every"):
            value = getattr(self, name)
            if value is None and name in ("eval_every", "checkpoint_every"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"fit({name}={value!r}): must be an integer >= 1")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"fit(seed={self.seed!r}): must be an integer")

    def pipelines(self, index: int) -> bool:
        """Whether step ``index`` (0-based) may be sent while the one before runs: it is part of
        this fit, and no evaluation or checkpoint comes between the two."""
        return (index < self.steps and not (self.eval_every and index % self.eval_every == 0)
                and not (self.checkpoint_every and index % self.checkpoint_every == 0))


@dataclass(frozen=True, kw_only=True)
class Shipped:
    """A dataset registered on every owner: its length, and for a ``zero_ray.data`` source
    what a checkpoint records of it and the order it is read in for training."""

    length: int
    identity: dict[str, Any] | None = None
    order: EpochOrder | BlockOrder | None = None


def _ship(stepper: Stepper, name: str, dataset: Any, collate_fn: Callable[[list[Any]], Any] | None, *,
          plan: FitPlan | None = None) -> Shipped:
    """Register ``dataset`` (a ``zero_ray.data`` source, a map-style dataset, or a zero-argument
    factory) on every owner. ``plan``: training, whose order it returns."""
    if collate_fn is not None and not callable(collate_fn):
        raise ConfigError(f"collate_fn={collate_fn!r} must be callable: list of samples -> batch")
    source = as_source(dataset)
    if source is not None:
        layout = source.scan()  # file sizes and footers only: no sample passes through the driver
        order = (BlockOrder(block_sizes=layout.block_sizes, global_batch_size=plan.global_batch_size, seed=plan.seed,
                            window=layout.window) if plan is not None else None)
        length = stepper.register_dataset(name, opener(layout, order), factory=True, collate=collate_fn)
        return Shipped(length=length, identity=layout.identity(), order=order)
    factory = callable(dataset) and not hasattr(dataset, "__getitem__")
    if not factory and not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise ConfigError(f"{name} dataset is a {type(dataset).__name__}; pass a zero_ray.data source (TokenFiles, "
                          "Parquet), a ray.data.Dataset, a map-style dataset (__len__ and __getitem__, e.g. "
                          "torch.utils.data.TensorDataset or datasets.Dataset) or a zero-argument factory that "
                          "builds one on each owner")
    shipped = dataset if factory else ray.put(dataset)  # the object store ships it to each owner once
    length = stepper.register_dataset(name, shipped, factory=factory, collate=collate_fn)
    order = (EpochOrder(length=length, global_batch_size=plan.global_batch_size, seed=plan.seed)
             if plan is not None else None)
    return Shipped(length=length, order=order)


def changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between two fit records, each as ``key: saved -> now`` (a source's files
    named one by one)."""
    out = []
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key), now.get(key)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            out += [f"{key}.{c}" for c in changes(a, b)]
        elif key == "files" and isinstance(a, list) and isinstance(b, list):
            gone = [f"{u} ({n} bytes)" for u, n in a if [u, n] not in b]
            new = [f"{u} ({n} bytes)" for u, n in b if [u, n] not in a]
            out.append(f"files: {len(a)} -> {len(b)} files; no longer read: {gone[:3]}; new or changed: {new[:3]}"
                       if gone or new else "files: the same files in another order")
        else:
            out.append(f"{key}: {a!r} -> {b!r}")
    return out


def fit(run: FitRun, dataset: Any, *, global_batch_size: int, steps: int, seed: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None, eval_dataset: Any = None,
        eval_every: int | None = None, checkpoint_every: int | None = None, progress: bool = True,
        callback: Callable[[StepMetrics], None] | None = None) -> dict[str, Any]:
    """See ``ZeroTrainer.fit``."""
    if callback is not None and not callable(callback):
        raise ConfigError(f"callback={callback!r} must be callable: metrics dict -> None")
    plan = FitPlan(global_batch_size=global_batch_size, steps=steps, seed=seed, eval_every=eval_every,
                   checkpoint_every=checkpoint_every)
    if plan.eval_every is not None and eval_dataset is None:
        raise ConfigError(f"fit(eval_every={plan.eval_every}) needs an eval_dataset")
    if plan.checkpoint_every is not None and run.checkpoint_dir is None:
        raise ConfigError(f"fit(checkpoint_every={plan.checkpoint_every}) needs "
                          "ZeroConfig(checkpoint=CheckpointConfig(dir=...))")
    stepper = run.stepper
    train = _ship(stepper, TRAIN, dataset, collate_fn, plan=plan)
    order = train.order
    assert order is not None
    record: dict[str, Any] = {"global_batch_size": order.global_batch_size, "seed": order.seed, "length": order.length}
    if train.identity is not None:
        record["source"] = train.identity
    run.extras.begin_fit(record)  # checked against the order of the fit a loaded checkpoint came from
    eval_length = _ship(stepper, EVAL, eval_dataset, collate_fn).length if eval_dataset is not None else 0
    bar = _progress(plan.steps, stepper.step_count) if progress else None
    result: dict[str, Any] = {}
    start, start_step, items = time.perf_counter(), stepper.step_count, 0.0
    try:
        k = stepper.step_count
        work = IndexedBatch(TRAIN, order.indices(k))
        while k < plan.steps and not stepper.stop_requested:
            # The next step goes to the owners while this one runs, unless something happens
            # between them: an evaluation, a checkpoint, the end (the controller may decline too).
            ahead = IndexedBatch(TRAIN, order.indices(k + 1)) if plan.pipelines(k + 1) else None
            metrics = stepper.step(work, ahead=ahead)
            items += metrics.item_count
            done = k = k + 1  # (not step_count: a call in the callback may have counted the step sent ahead)
            work = ahead if ahead is not None else IndexedBatch(TRAIN, order.indices(k))
            result.update(step=done, loss=metrics.loss, epoch=order.position(done - 1)[0],
                          items_per_second=items / max(time.perf_counter() - start, 1e-9))
            if plan.eval_every is not None and (done % plan.eval_every == 0 or done == plan.steps):
                result["eval_loss"] = evaluate_dataset(stepper, eval_length, plan.global_batch_size)["loss"]
                metrics = metrics.with_eval_loss(result["eval_loss"])
            if plan.checkpoint_every is not None and done % plan.checkpoint_every == 0:
                result["checkpoint"] = run.save_checkpoint()  # the configured dir and filesystem
            if callback is not None:
                callback(metrics)
            if bar is not None:
                bar.set_postfix(_postfix(result))
                bar.update(1)
            else:
                log.info("step %d/%d: %s", done, plan.steps, _postfix(result))
    finally:
        if bar is not None:
            bar.close()
    result.setdefault("step", stepper.step_count)
    result["steps_run"] = stepper.step_count - start_step
    result["order"] = {k: v for k, v in asdict(order).items() if k != "block_sizes"}
    return result


def evaluate_dataset(stepper: Stepper, length: int, global_batch_size: int) -> dict[str, float]:
    """The loss over the whole registered evaluation dataset, forward only: every sample once,
    in index order, in chunks of ``global_batch_size``."""
    loss_sum, weight, samples, items = 0.0, 0.0, 0, 0.0
    for chunk in evaluation_chunks(length, global_batch_size, stepper.world_size):
        out = stepper.evaluate(IndexedBatch(EVAL, chunk))
        per = out.get("count", out["samples"])  # the mean is over items when counted, else samples
        loss_sum += out["loss"] * per
        weight += per
        samples += int(out["samples"])
        items += out["items"]
    return {"loss": loss_sum / weight if weight else math.nan, "samples": samples, "items": items}


def _postfix(result: dict[str, Any]) -> dict[str, str]:
    out = {"loss": f"{result.get('loss', math.nan):.4f}", "items/s": f"{result.get('items_per_second', 0):,.0f}"}
    if "eval_loss" in result:
        out["eval"] = f"{result['eval_loss']:.4f}"
    return out


def _progress(total: int, initial: int):  # type: ignore[no-untyped-def]
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="fit", unit="step", dynamic_ncols=True)
