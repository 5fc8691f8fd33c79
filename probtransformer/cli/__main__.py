"""``python -m probtransformer.cli``: the ``probtransformer`` command."""

import sys

from probtransformer.cli._main import main

sys.exit(main())
