"""``python -m sim``: same as ``inferlb sim-backend``."""

from sim.cli import sim_backend

if __name__ == "__main__":
    sim_backend()
