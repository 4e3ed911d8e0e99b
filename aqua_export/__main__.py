"""``python -m aqua_export ...`` (what ``torchrun -m aqua_export calibrate ...`` starts on every rank)."""

import sys

from .cli import main

sys.exit(main())
