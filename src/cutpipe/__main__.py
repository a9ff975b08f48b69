"""``python -m cutpipe``: the command line, also what ``torchrun ... -m cutpipe train`` runs."""

import sys

from cutpipe.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
