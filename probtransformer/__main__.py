"""``python -m probtransformer``: the ``probtransformer`` command (as ``torchrun -m`` needs)."""

import sys

from probtransformer.cli._main import main

sys.exit(main())
