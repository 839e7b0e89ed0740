import sys

from hetdp.cli import main

sys.exit(main())
