"""``python -m hmad_openai``: the same as the ``hmad-openai`` console script."""

import sys

from hmad_openai.cli import main

sys.exit(main())
