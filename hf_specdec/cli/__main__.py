"""``python -m hf_specdec.cli`` (and ``accelerate launch -m hf_specdec.cli``): the ``hf-specdec`` command."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
