"""Training forward that equals the sampler (promise E11): memra.train.Trainer (trainer.py)."""

from memra.train.trainer import Trainer

__all__ = ["Trainer"]
