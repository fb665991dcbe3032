"""Compiled training on Ray actors (``ZeroConfig(compile=True)``): a stage-3 run of Hugging Face
Llama equals single-process torch with the same blocks compiled, through a grow in which the new
owner compiles (its first step timed against a warm one), and its checkpoint and export carry
the plain module's names. The stage x world-size matrix is on thread ranks
(tests/unit/test_compile_threads.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import zero_ray as zr
from finetune_models import causal_lm_loss, compiled_by_hand, llama, token_batches
from zero_ray.checkpoint.format import MANIFEST_NAME
from zero_ray.testing import single_process

pytestmark = pytest.mark.usefixtures("ray_session")
BLOCK = "LlamaDecoderLayer"


@pytest.mark.timeout(600)
def test_a_compiled_stage3_run_through_a_grow_equals_compiled_torch(tmp_path: Path) -> None:
    opt = zr.SGD(lr=0.1, momentum=0.9)
    batches = token_batches(steps=5, n=6)
    ref, _ = single_process(compiled_by_hand(llama, BLOCK), causal_lm_loss, opt, batches, pieces=(2, 1))
    config = zr.ZeroConfig(stage=3, world_size=2, compile=True, stage3=zr.Stage3Config(wrap_policy=(BLOCK,)),
                           elastic=zr.ElasticConfig(max_world_size=3))
    trainer = zr.ZeroTrainer(llama, causal_lm_loss, optimizer=opt, config=config)
    took: list[float] = []
    try:
        for k, batch in enumerate(batches):
            if k == 3:
                saved = trainer.save_checkpoint(tmp_path / "ckpt", wait=True)
                trainer.export_pretrained(tmp_path / "export")
                trainer.resize(3)  # the new owner compiles its blocks in its first step
            start = time.perf_counter()
            trainer.step(batch)
            took.append(time.perf_counter() - start)
        got = trainer.full_state_dict()
    finally:
        trainer.shutdown()
    print(f"step times (s): {', '.join(f'{t:.2f}' for t in took)}; the first compiles at 2 owners, "
          f"the fourth is the grown pool's first (its new owner compiles)")
    assert max(float((got[n] - ref[n]).abs().max()) for n in ref) <= 1e-6  # the last steps split 3 ways, not 2
    assert not [n for n in got if "_orig_mod" in n]
    manifest = json.loads((Path(saved) / MANIFEST_NAME).read_text())
    assert "_orig_mod" not in json.dumps(manifest)
    index = (tmp_path / "export" / "model.safetensors").read_bytes()[:4096]
    assert b"_orig_mod" not in index and b"model.layers.0.self_attn.q_proj.weight" in index
