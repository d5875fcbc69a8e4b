"""`python -m klppo.trainer.main_ppo`: verl's entry-point name for `klppo train` (see
klppo.commands.train)."""

from klppo.commands.train import _exit_rank, main

__all__ = ["main"]

if __name__ == "__main__":
    _exit_rank(main())
