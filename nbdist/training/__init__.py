"""Training runs from the notebook: nbdist.Trainer (trainer.py), its history (history.py), checkpoints
(checkpoints.py); the loop itself runs on the ranks (nbdist/training/ranks/training.py)."""
