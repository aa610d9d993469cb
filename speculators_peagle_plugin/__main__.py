"""``python -m speculators_peagle_plugin`` (and ``torchrun -m speculators_peagle_plugin``)."""

from .cli import main

if __name__ == "__main__":
    main()
