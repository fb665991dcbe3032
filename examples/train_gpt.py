"""The main job: train a small GPT on the Python standard library's sources with ZeRO stage 2
on two Ray actors (a local Ray is started when none is running).

    python examples/train_gpt.py                 # defaults: stage 2, 2 actors, CPU unless GPUs
    python examples/train_gpt.py --stage 3 --world-size 4 --steps 500
"""

from __future__ import annotations

import sys

from zero_ray.demo import main

if __name__ == "__main__":
    sys.exit(main())
