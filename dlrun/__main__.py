"""``python -m dlrun``: the same as the ``dlrun`` console script."""

from dlrun.cli import main

if __name__ == "__main__":
    main()
