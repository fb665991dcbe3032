"""A ``ZeroConfig`` read into the two specs a run starts from: what every owner builds and runs
(``EngineSpec``: model, loss, optimizers, numerics) and how the owners are placed and started
(``PoolSpec``: how many, where, timeouts, the control plane's settings, what an attaching driver
reads back). ``ZeroTrainer`` builds both once, at start-up."""

from __future__ import annotations

from zero_ray.config import ZeroConfig
from zero_ray.core.optimizer_plan import OptimizerFactory, SchedulerFactory
from zero_ray.core.precision import parse_dtype
from zero_ray.core.stages import stage_plan
from zero_ray.driver.pool_spec import PoolSpec
from zero_ray.errors import ConfigError
from zero_ray.owner.step.run_spec import EngineSpec, LossFn, ModelFn, RunSpec


def engine_spec(cfg: ZeroConfig, *, model_fn: ModelFn, loss_fn: LossFn, optimizers: tuple[OptimizerFactory, ...],
                lr_scheduler: SchedulerFactory | None, device: str) -> EngineSpec:
    """What every owner needs to build the same model state and step it as ``cfg`` says."""
    return EngineSpec(model_fn=model_fn, loss_fn=loss_fn, optimizers=optimizers,
                      plan=stage_plan(cfg.stage), compute_dtype=parse_dtype(cfg.dtype), device=device,
                      seed=cfg.seed, bucket_bytes=cfg.bucket_bytes, grad_accum_steps=cfg.grad_accum_steps,
                      max_grad_norm=cfg.max_grad_norm, loss_scale=cfg.loss_scale, stage3=cfg.stage3,
                      init_state_dict=cfg.init_state_dict,
                      activation_checkpointing=cfg.activation_checkpointing, compile=cfg.compile,
                      offload=cfg.offload, lr_scheduler=lr_scheduler, optimizer_kinds=cfg.optimizer_kinds,
                      reduce_dtype=parse_dtype(cfg.reduce_dtype) if cfg.reduce_dtype else None,
                      on_nonfinite=cfg.on_nonfinite, topology=cfg.topology,
                      tensor_parallel=cfg.tensor_parallel)


def pool_spec(cfg: ZeroConfig, *, device: str, backend: str, optimizer: OptimizerFactory | list[OptimizerFactory],
              lr_scheduler: SchedulerFactory | None) -> PoolSpec:
    """How ``cfg``'s owners are placed and started on ``device`` over ``backend``; a detached
    run's owners keep the config and factories (``optimizer``, ``lr_scheduler``) for a driver
    that attaches later."""
    elastic = cfg.elastic
    tp = cfg.tensor_parallel.size
    if tp > 1 and cfg.placement_strategy == "STRICT_SPREAD":
        # every owner on a node of its own would split each TP group across nodes
        raise ConfigError(f"placement_strategy='STRICT_SPREAD' puts every owner on a node of its own, but "
                          f"tensor_parallel size={tp} keeps each group of {tp} owners on one node; use 'PACK' "
                          "or 'SPREAD' (TP groups are pinned to a node each) or 'STRICT_PACK'")
    return PoolSpec(world_size=cfg.world_size, tensor_parallel=tp, use_gpu=device == "cuda",
                    num_cpus_per_owner=cfg.num_cpus_per_owner, backend=backend,
                    placement_strategy=cfg.placement_strategy, collective_timeout_s=cfg.collective_timeout_s,
                    init_timeout_s=cfg.init_timeout_s, capacity_timeout_s=cfg.capacity_timeout_s,
                    health_interval_s=cfg.health_interval_s,
                    health_timeout_s=cfg.health_timeout_s, tls=cfg.control_tls, relays=cfg.relays,
                    snapshot_every=elastic.snapshot_every if elastic.redundancy == "peer" else 0,
                    detached=elastic.detached, orphan_timeout_s=elastic.orphan_timeout_s,
                    run=RunSpec(detached=elastic.detached, config=cfg, optimizer=optimizer,
                                lr_scheduler=lr_scheduler))
