"""`python -m trainer`: the commands are trainer/cli/main.py's."""

import sys

from trainer.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
