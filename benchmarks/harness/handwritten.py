"""The AdamW arithmetic zero_ray ran before it ran the user's own ``torch.optim`` optimizer, kept
for the benchmark's A/B only (``zero1-hand`` against ``zero1``, ``zero1-foreach`` and
``zero1-fused``).

It was one pass of eight tensor operations over a rank's whole flat shard (weight decay by
ranges). Under the new engine an optimizer is handed one view per parameter fragment; this
class merges every run of fragments that lie next to each other in one flat buffer (so are
their gradients and, from the second step on, their states) and runs the same eight
operations over each merged run: the kernel count of the old path, the arithmetic of
``torch.optim.AdamW``'s single-tensor implementation.
"""

from __future__ import annotations

from typing import Any

import torch


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.storage_offset() + a.numel() == b.storage_offset())


def _merged(run: list[torch.Tensor]) -> torch.Tensor:
    """One 1-D tensor over the storage that ``run`` (adjacent 1-D views) covers."""
    first = run[0]
    if len(run) == 1:
        return first
    total = sum(t.numel() for t in run)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (total,), (1,))


class HandWrittenAdamW(torch.optim.Optimizer):
    """AdamW as zero_ray's flat-shard update computed it (declare it element-wise to run it)."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        entries = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                entries.append((p, group, state))
        # Runs of neighbours in one flat buffer (parameters, gradients and both states alike)
        # taking the same step with the same lr, betas and eps: one update each, as before.
        entries.sort(key=lambda e: (e[0].untyped_storage().data_ptr(), e[0].storage_offset()))
        runs: list[list[tuple[torch.Tensor, dict[str, Any], dict[str, Any]]]] = []
        for e in entries:
            if runs:
                p0, g0, s0 = runs[-1][-1]
                p, g, s = e
                same = (g["lr"], g["betas"], g["eps"], float(s["step"])) == \
                       (g0["lr"], g0["betas"], g0["eps"], float(s0["step"]))
                if same and all(_adjacent(a, b) for a, b in ((p0, p), (p0.grad, p.grad),
                                                             (s0["exp_avg"], s["exp_avg"]),
                                                             (s0["exp_avg_sq"], s["exp_avg_sq"]))):
                    runs[-1].append(e)
                    continue
            runs.append([e])
        for run in runs:
            self._update(run)

    @staticmethod
    def _update(run: list[tuple[torch.Tensor, dict[str, Any], dict[str, Any]]]) -> None:
        group, state = run[0][1], run[0][2]
        lr, (beta1, beta2), eps, step = group["lr"], group["betas"], group["eps"], float(state["step"])
        param = _merged([p for p, _, _ in run])
        grad = _merged([p.grad for p, _, _ in run])
        exp_avg = _merged([s["exp_avg"] for _, _, s in run])
        exp_avg_sq = _merged([s["exp_avg_sq"] for _, _, s in run])
        start = 0
        for p, g, _ in run:  # weight decay by ranges
            if g["weight_decay"] != 0:
                param[start:start + p.numel()].mul_(1 - lr * g["weight_decay"])
            start += p.numel()
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


def handwritten_adamw(lr: float, weight_decay: float) -> Any:
    """A factory with the benchmark's weight-decay groups (those ``zr.AdamW`` builds)."""
    from zero_ray.core.optimizer_plan import decay_groups

    def factory(module: torch.nn.Module) -> HandWrittenAdamW:
        return HandWrittenAdamW(decay_groups(module, weight_decay, None), lr=lr, weight_decay=weight_decay)

    return factory
