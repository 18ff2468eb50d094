"""``python -m gpudist.live``: the launcher (:func:`gpudist.live.launcher.main`)."""

import sys

from .launcher import main

if __name__ == "__main__":
    sys.exit(main())
