"""``python -m ep_comm ...`` is ``ep-comm ...`` (see ``ep_comm.cli.main``)."""
import sys

from ep_comm.cli.main import main

if __name__ == "__main__":  # spawned ranks re-import this module: only the real entry runs main
    sys.exit(main())
