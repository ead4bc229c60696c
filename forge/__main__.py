"""`python -m forge ...` runs the command line (the same as the `forge` console script)."""

from forge_cli.cli import main

if __name__ == "__main__":
    main()
